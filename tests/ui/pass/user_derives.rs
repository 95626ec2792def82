// Derives the user writes on the struct replace the macro's own Clone and Debug impls.
conv_runtime::conv2d! {
    #[derive(Clone, Debug)]
    pub struct Layer { input: [6, 6, 2], out_channels: 3, kernel: 3 }
}

fn main() {
    let layer = Layer::new(&mut conv_runtime::Rng::seed_from_u64(0));
    let copy = layer.clone();
    assert_eq!(format!("{copy:?}").is_empty(), false);
}
