conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            conv: Conv2d { out_channels: 4, kernel: 3 },
            fc: Dense { out_features: 10 },
        ],
    }
}

fn main() {}
