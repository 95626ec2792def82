conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 0, 3],
        out_channels: 6,
        kernel: 3,
    }
}

fn main() {}
