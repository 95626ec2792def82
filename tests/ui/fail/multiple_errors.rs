// Three independent mistakes, all reported by one compile.
conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 0,
        kernel: 3,
        strides: 2,
        activation: Swish,
    }
}

fn main() {}
