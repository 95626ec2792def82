// The output tensor would have 4 * 1024 * 1024 * 1024 = 2^32 elements.
conv_runtime::conv2d! {
    pub struct Layer {
        input: [1024, 1024, 3],
        out_channels: 1024,
        kernel: 1,
        batch: 4,
    }
}

fn main() {}
