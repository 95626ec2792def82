conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            conv1: Conv2d { out_channels: 4, kernel: 4, stride: 4 },
            conv2: Conv2d { out_channels: 4, kernel: 3 },
        ],
    }
}

fn main() {}
