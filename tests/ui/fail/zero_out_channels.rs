conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 0,
        kernel: 3,
    }
}

fn main() {}
