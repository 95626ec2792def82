//! A dense classification head for the features a stack of conv layers produces: `logits =
//! W h + b` and the mean soft-max cross-entropy with its gradients, on the host.
//!
//! Conv layers end in a feature map; a classifier (or a policy's action logits) needs one small
//! dense layer after it. This is that layer, with PyTorch's `nn.Linear` initialization and
//! parameter names, and [`Parameters`] so the same optimizers step it.

use crate::{Error, ParamTensor, Parameters, Real, Result, Rng, Tensor, Vector};

/// `logits = weight · h + bias` for `IN` features and `OUT` classes.
#[derive(Clone, Debug)]
pub struct Linear<T, const IN: usize, const OUT: usize> {
    /// `[OUT][IN]` row-major, as PyTorch's `nn.Linear.weight` (stored as `[OUT, 1, 1, IN]`).
    pub weight: Tensor<T, OUT, 1, 1, IN>,
    /// One per class.
    pub bias: Vector<T, OUT>,
}

/// Gradients of a [`Linear`] head.
#[derive(Clone, Debug)]
pub struct LinearGrads<T, const IN: usize, const OUT: usize> {
    /// Gradient of `weight`.
    pub weight: Tensor<T, OUT, 1, 1, IN>,
    /// Gradient of `bias`.
    pub bias: Vector<T, OUT>,
}

impl<T: Real, const IN: usize, const OUT: usize> LinearGrads<T, IN, OUT> {
    /// Zero gradients.
    pub fn zeros() -> Self {
        Self {
            weight: Tensor::zeros(),
            bias: Vector::zeros(),
        }
    }

    /// Sets every gradient to zero.
    pub fn zero(&mut self) {
        self.weight.fill(T::zero());
        self.bias.fill(T::zero());
    }
}

/// What [`Linear::softmax_cross_entropy`] measured on a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Loss<T> {
    /// Mean cross-entropy over the batch.
    pub mean: T,
    /// Samples whose largest logit is their label.
    pub correct: usize,
}

impl<T: Real, const IN: usize, const OUT: usize> Linear<T, IN, OUT> {
    /// PyTorch's `nn.Linear` initialization: weights and biases uniform in `±1/sqrt(IN)`.
    pub fn new(rng: &mut Rng) -> Self {
        let bound = 1.0 / (IN as f64).sqrt();
        Self {
            weight: Tensor::from_fn(|_| T::from_f64(rng.uniform(-bound, bound))),
            bias: Vector::from_fn(|_| T::from_f64(rng.uniform(-bound, bound))),
        }
    }

    /// The logits of each sample of `h` (`IN` features per sample, samples back to back).
    pub fn logits(&self, h: &[T]) -> Result<Vec<[T; OUT]>> {
        if IN == 0 || OUT == 0 {
            return Err(Error::new(
                "Linear::logits",
                "a head needs at least one feature and one class",
            ));
        }
        if !h.len().is_multiple_of(IN) {
            return Err(Error::new(
                "Linear::logits",
                format!(
                    "{} features are not a whole number of {IN}-feature samples",
                    h.len()
                ),
            ));
        }
        let (w, b) = (self.weight.as_slice(), self.bias.as_slice());
        Ok(h.chunks_exact(IN)
            .map(|h| {
                std::array::from_fn(|k| {
                    let row = &w[k * IN..(k + 1) * IN];
                    row.iter().zip(h).fold(b[k], |s, (&a, &x)| s + a * x)
                })
            })
            .collect())
    }

    /// The mean soft-max cross-entropy of the batch `h` against `labels` (one per sample) and
    /// how many samples it classifies correctly; adds the head's gradients into `grads` and
    /// writes the gradient with respect to `h` into `d_h` (the conv layers' `d_output`).
    pub fn softmax_cross_entropy(
        &self,
        h: &[T],
        labels: &[usize],
        grads: &mut LinearGrads<T, IN, OUT>,
        d_h: &mut [T],
    ) -> Result<Loss<T>> {
        let operation = "Linear::softmax_cross_entropy";
        if OUT == 0 {
            return Err(Error::new(operation, "a head needs at least one class"));
        }
        if h.len() != labels.len() * IN || d_h.len() != h.len() {
            return Err(Error::new(
                operation,
                format!(
                    "{} labels need {} features and as many gradients, got {} and {}",
                    labels.len(),
                    labels.len() * IN,
                    h.len(),
                    d_h.len()
                ),
            ));
        }
        if let Some(&label) = labels.iter().find(|&&l| l >= OUT) {
            return Err(Error::new(
                operation,
                format!("label {label} is not one of the {OUT} classes"),
            ));
        }
        let n = T::from_f64(labels.len().max(1) as f64);
        let w = self.weight.as_slice();
        let (d_w, d_b) = (grads.weight.as_mut_slice(), grads.bias.as_mut_slice());
        let mut loss = T::zero();
        let mut correct = 0;
        for (i, (z, &label)) in self.logits(h)?.iter().zip(labels).enumerate() {
            correct += usize::from(argmax(z) == label);
            let max = z.iter().fold(z[0], |m, &v| m.max(v));
            let exp: [T; OUT] = std::array::from_fn(|k| (z[k] - max).exp());
            let sum = exp.iter().fold(T::zero(), |s, &e| s + e);
            loss += sum.ln() + max - z[label];
            let h_i = &h[i * IN..(i + 1) * IN];
            let d_h_i = &mut d_h[i * IN..(i + 1) * IN];
            d_h_i.fill(T::zero());
            for k in 0..OUT {
                let target = if k == label { T::ONE } else { T::zero() };
                let d_z = (exp[k] / sum - target) / n;
                d_b[k] += d_z;
                let d_w_k = &mut d_w[k * IN..(k + 1) * IN];
                let w_k = &w[k * IN..(k + 1) * IN];
                for j in 0..IN {
                    d_w_k[j] += d_z * h_i[j];
                    d_h_i[j] += d_z * w_k[j];
                }
            }
        }
        Ok(Loss {
            mean: loss / n,
            correct,
        })
    }
}

/// The index of the largest value (the first of equal ones); 0 for an empty slice.
pub fn argmax<T: PartialOrd>(values: &[T]) -> usize {
    (1..values.len()).fold(0, |best, k| if values[k] > values[best] { k } else { best })
}

impl<T: Real, const IN: usize, const OUT: usize> Parameters for Linear<T, IN, OUT> {
    type Elem = T;
    type Grads = LinearGrads<T, IN, OUT>;

    fn visit_mut(
        &mut self,
        grads: &Self::Grads,
        f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>, &[T]),
    ) {
        f("weight", &mut self.weight, grads.weight.as_slice());
        f("bias", &mut self.bias, grads.bias.as_slice());
    }

    fn visit(&self, f: &mut dyn FnMut(&str, &[T])) {
        f("weight", self.weight.as_slice());
        f("bias", self.bias.as_slice());
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&str, &mut dyn ParamTensor<T>)) {
        f("weight", &mut self.weight);
        f("bias", &mut self.bias);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradients match central differences of the loss, in f64.
    #[test]
    fn gradients_match_finite_differences() -> Result<()> {
        let mut rng = Rng::seed_from_u64(3);
        let head = Linear::<f64, 5, 3>::new(&mut rng);
        let h: Vec<f64> = (0..10).map(|_| rng.normal()).collect();
        let labels = [2, 0];
        let mut grads = LinearGrads::zeros();
        let mut d_h = vec![0.0; 10];
        head.softmax_cross_entropy(&h, &labels, &mut grads, &mut d_h)?;
        let loss = |head: &Linear<f64, 5, 3>, h: &[f64]| {
            let mut g = LinearGrads::zeros();
            let mut d = vec![0.0; h.len()];
            head.softmax_cross_entropy(h, &labels, &mut g, &mut d)
                .map(|loss| loss.mean)
        };
        // Central difference of the loss in one scalar that `nudge(head, h, by)` moves.
        let eps = 1e-6;
        type Head = Linear<f64, 5, 3>;
        let numeric = |nudge: &dyn Fn(&mut Head, &mut [f64], f64)| {
            let (mut up, mut up_h) = (head.clone(), h.clone());
            let (mut down, mut down_h) = (head.clone(), h.clone());
            nudge(&mut up, &mut up_h, eps);
            nudge(&mut down, &mut down_h, -eps);
            Ok::<f64, Error>((loss(&up, &up_h)? - loss(&down, &down_h)?) / (2.0 * eps))
        };
        for j in 0..h.len() {
            let n = numeric(&|_, h, by| h[j] += by)?;
            assert!((n - d_h[j]).abs() < 1e-8, "d_h[{j}]");
        }
        for i in 0..15 {
            let n = numeric(&|head, _, by| head.weight.as_mut_slice()[i] += by)?;
            assert!(
                (n - grads.weight.as_slice()[i]).abs() < 1e-8,
                "d_weight[{i}]"
            );
        }
        for k in 0..3 {
            let n = numeric(&|head, _, by| head.bias.as_mut_slice()[k] += by)?;
            assert!((n - grads.bias.as_slice()[k]).abs() < 1e-8, "d_bias[{k}]");
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_labels_are_errors() {
        let head = Linear::<f32, 4, 2>::new(&mut Rng::seed_from_u64(1));
        let mut grads = LinearGrads::zeros();
        let h = [0.5f32; 8];
        let mut d_h = [0.0f32; 8];
        let e = head
            .softmax_cross_entropy(&h, &[0], &mut grads, &mut d_h)
            .unwrap_err();
        assert!(e.to_string().contains("softmax_cross_entropy"), "{e}");
        let e = head
            .softmax_cross_entropy(&h, &[0, 2], &mut grads, &mut d_h)
            .unwrap_err();
        assert!(e.to_string().contains("label 2"), "{e}");
        assert!(head.logits(&h[..5]).is_err());
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
