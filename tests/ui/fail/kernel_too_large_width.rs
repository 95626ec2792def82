conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: [3, 9],
    }
}

fn main() {}
