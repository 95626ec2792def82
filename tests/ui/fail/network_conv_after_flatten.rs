conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            flat: Flatten,
            conv: Conv2d { out_channels: 4, kernel: 3 },
        ],
    }
}

fn main() {}
