use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    /// Every key, none at its default.
    #[repr(C)]
    pub struct Layer {
        input: [9, 12, 3],
        out_channels: 5,
        kernel: [3, 5],
        stride: [2, 1],
        padding: [1, 2],
        activation: Gelu,
        norm: LayerNorm { eps: 1e-3 },
        batch: 2,
        dtype: f64,
        init: KaimingUniform { legacy: false, scale: 2.0 },
    }
}

fn main() {
    // (9 + 2 * 1 - 3) / 2 + 1 = 5 and (12 + 2 * 2 - 5) / 1 + 1 = 12.
    assert_eq!((Layer::OUTPUT_HEIGHT, Layer::OUTPUT_WIDTH, Layer::OUTPUT_CHANNELS), (5, 12, 5));
    assert_eq!((Layer::KERNEL_HEIGHT, Layer::KERNEL_WIDTH), (3, 5));
    assert_eq!((Layer::STRIDE_HEIGHT, Layer::STRIDE_WIDTH), (2, 1));
    assert_eq!((Layer::PADDING_HEIGHT, Layer::PADDING_WIDTH), (1, 2));
    assert_eq!(Layer::BATCH_SIZE, 2);

    let mut cpu = Cpu::default();
    let mut rng = Rng::seed_from_u64(42);
    let mut layer = Layer::new(&mut rng);
    let mut grads = LayerGrads::zeros();
    let mut state = LayerState::new();

    // Typed fields: f64 elements, a LayerNorm's gamma and beta, no running statistics.
    let _: &Tensor<f64, 5, 3, 5, 3> = &layer.weights;
    let _: &Vector<f64, 5> = &layer.biases;
    let _: &Vector<f64, 5> = &layer.gamma;
    let _: &Vector<f64, 5> = &layer.beta;

    let x = Tensor::<f64, 2, 9, 12, 3>::from_fn(|i| (i % 11) as f64 / 11.0 - 0.5);
    let mut y = Tensor::<f64, 3, 5, 12, 5>::zeros();
    let x3 = Tensor::<f64, 3, 9, 12, 3>::zeros();
    layer.evaluate(&mut cpu, &x3, &mut y).unwrap();

    layer.forward(&mut cpu, &x, &mut state, Mode::Train).unwrap();
    let d_output = Tensor::<f64, 2, 5, 12, 5>::from_fn(|i| (i % 3) as f64);
    let mut d_input = Tensor::<f64, 2, 9, 12, 3>::zeros();
    let _: &Tensor<f64, 2, 5, 12, 5> = state.output();
    layer
        .backward_full(&mut cpu, &state, &x, &d_output, &mut d_input, &mut grads, Mode::Train)
        .unwrap();
    grads.zero();
}
