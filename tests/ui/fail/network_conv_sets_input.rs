conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            conv: Conv2d { input: [8, 8, 3], out_channels: 4, kernel: 3 },
        ],
    }
}

fn main() {}
