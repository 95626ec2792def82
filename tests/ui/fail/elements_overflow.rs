conv_runtime::conv2d! {
    pub struct Layer {
        input: [9223372036854775808, 9223372036854775808, 1],
        out_channels: 1,
        kernel: 1,
        batch: 9223372036854775808,
    }
}

fn main() {}
