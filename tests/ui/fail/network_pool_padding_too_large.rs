conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            pool: AvgPool2d { kernel: 2, padding: 2 },
        ],
    }
}

fn main() {}
