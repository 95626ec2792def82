//! What sits after a network's output: the predicted class of a row of logits.
//!
//! The dense layer itself is `network!`'s `Dense` (one dense layer in the codebase), and the
//! losses are in [`crate::loss`].

/// The index of the largest value (the first of equal ones); 0 for an empty slice.
pub fn argmax<T: PartialOrd>(values: &[T]) -> usize {
    (1..values.len()).fold(0, |best, k| if values[k] > values[best] { k } else { best })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equals() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[2.0f64]), 0);
        assert_eq!(argmax::<f32>(&[]), 0);
    }
}
