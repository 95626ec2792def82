// A syntax error still defines the names, so only the syntax error is reported.
conv_runtime::conv2d! {
    pub struct Layer { input: [6, 6, 2] out_channels: 3, kernel: 3 }
}

fn main() {
    let mut rng = conv_runtime::Rng::seed_from_u64(0);
    let _layer = Layer::new(&mut rng);
    let _grads = LayerGrads::zeros();
    let _state = LayerState::new();
}
