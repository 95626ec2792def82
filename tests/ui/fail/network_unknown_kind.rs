conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [
            pool: MaxPool { kernel: 2 },
        ],
    }
}

fn main() {}
