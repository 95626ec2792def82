conv_runtime::conv2d! {
    pub struct Layer {
        input: [4, 10, 3],
        out_channels: 6,
        kernel: 7,
        padding: 1,
    }
}

fn main() {}
