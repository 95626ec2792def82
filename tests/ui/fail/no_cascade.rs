// An invalid spec still defines the names, so code naming them reports only the spec's error.
conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: 3,
        activation: Relu6,
    }
}

pub fn step(_layer: &Layer, _grads: &mut LayerGrads, _state: &LayerState) {}

fn main() {}
