//! Parameter initialization (rl_tools' `KaimingUniform`, PyTorch's `Conv2d` default).

use crate::element::Element;
use crate::rng::Rng;

/// Kaiming-uniform initialization of a layer's weights (OHWI) and biases with
/// `fan_in = IC * KH * KW`.
///
/// `legacy` (PyTorch's default `Conv2d` init): gain `sqrt(2 / (1 + 5))`, so weights and biases are
/// uniform in `±1/sqrt(fan_in)`. Otherwise gain `sqrt(2) * scale`, weights uniform in
/// `±sqrt(3) * gain / sqrt(fan_in)`, biases zero. Draws per output channel, bias first, in the
/// order rl_tools uses.
pub fn kaiming_uniform<T: Element>(
    rng: &mut Rng,
    weights: &mut [T],
    biases: &mut [T],
    fan_in: usize,
    legacy: bool,
    scale: f64,
) {
    let fan = fan_in as f64;
    let gain = if legacy {
        (2.0f64 / 6.0).sqrt()
    } else {
        2.0f64.sqrt() * scale
    };
    let weight_bound = 3.0f64.sqrt() * gain / fan.sqrt();
    let bias_bound = 1.0 / fan.sqrt();
    let per_channel = weights.len() / biases.len().max(1);
    for (bias, row) in biases.iter_mut().zip(weights.chunks_mut(per_channel)) {
        *bias = if legacy {
            T::from_f64(rng.uniform(-bias_bound, bias_bound))
        } else {
            T::zero()
        };
        for w in row {
            *w = T::from_f64(rng.uniform(-weight_bound, weight_bound));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_fan_in() {
        let mut rng = Rng::seed_from_u64(1);
        let (mut w, mut b) = (vec![0.0f64; 4 * 27], vec![0.0f64; 4]);
        kaiming_uniform(&mut rng, &mut w, &mut b, 27, true, 1.0);
        let bound = 1.0 / 27f64.sqrt();
        assert!(w.iter().chain(&b).all(|v| v.abs() <= bound));
        assert!(w.iter().any(|v| v.abs() > 0.8 * bound));
        kaiming_uniform(&mut rng, &mut w, &mut b, 27, false, 1.0);
        assert!(b.iter().all(|&v| v == 0.0));
        let bound = 3f64.sqrt() * 2f64.sqrt() / 27f64.sqrt();
        assert!(w.iter().all(|v| v.abs() <= bound) && w.iter().any(|v| v.abs() > bound / 2.0));
    }
}
