use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: 3,
        activation: Relu6,
    }
}

fn main() {
    let mut cpu = Cpu::default();
    let layer = Layer::new(&mut Rng::seed_from_u64(0));
    let x = Tensor::<f32, 1, 8, 8, 3>::zeros();
    let mut y = Tensor::<f32, 1, 6, 6, 6>::zeros();
    layer.evaluate(&mut cpu, &x, &mut y).unwrap();
    let _grads = LayerGrads::zeros();
    assert_eq!(Layer::OUTPUT_HEIGHT, 6);
}
