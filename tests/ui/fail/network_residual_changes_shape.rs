conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            block: Residual {
                layers: [
                    conv: Conv2d { out_channels: 8, kernel: 3, padding: 1, activation: Relu },
                ],
            },
        ],
    }
}

fn main() {}
