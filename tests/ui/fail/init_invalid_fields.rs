// Two mistakes inside `KaimingUniform { .. }`, both reported.
conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: 3,
        init: KaimingUniform { legacy: 1, scale: 0.0 },
    }
}

fn main() {}
