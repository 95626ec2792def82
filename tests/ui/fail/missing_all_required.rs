// Each missing required key is its own error, all at the struct's name.
conv_runtime::conv2d! {
    pub struct Layer {
        stride: 2,
        activation: Relu,
    }
}

fn main() {}
