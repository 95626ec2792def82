conv_runtime::network! {
    pub struct Net {
        input: [8, 8, 3],
        layers: [],
    }
}

fn main() {}
