conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            conv: Conv2d { out_channels: 4, kernel: 5 },
            pool: MaxPool2d { kernel: 5 },
        ],
    }
}

fn main() {}
