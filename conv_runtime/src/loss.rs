//! Losses of a batch of flat network outputs (a [`Matrix`], one row per sample): each returns
//! the loss and writes its gradient with respect to the output, the `d_output` a network's
//! backward pass starts from.
//!
//! - Reduction: the mean over the batch, PyTorch's default (`reduction="mean"`), so a learning
//!   rate tuned in PyTorch carries over and the gradient's scale does not grow with the batch.
//!   [`mse`] is PyTorch's `mse_loss` and averages over every element, as it does.
//! - Arithmetic: in f64 for every element type. The inputs widen exactly, so the loss is the
//!   float64 value of PyTorch's formula to f64 rounding whatever the network's type, and each
//!   gradient element is rounded into the element type once, the nearest value it can hold
//!   (f16 and bf16 too: no intermediate f32 rounding). It costs nothing that matters: a loss
//!   reads `B x N` values, next to the network's passes over every layer. The accumulator type
//!   would save little and lose that: f32 sums of a soft-max over many classes carry their own
//!   error, and this crate's f32 `exp` trades a few ulp for vectorized activations.
//! - Validation comes first: a label or action out of range, a non-finite value in the output
//!   or the targets, or a slice of the wrong length is an [`Error`] naming the loss, and the
//!   gradient is then not written at all (not even its stamp changes). A NaN or an infinity in
//!   the network's output means training has already diverged; stopping here keeps it from
//!   reaching every parameter through the gradient and the optimizer.
//! - The gradient is written (`=`), not accumulated: the network's backward pass accumulates
//!   into its parameter gradients, while `d_output` is an input of that pass.

use crate::{Element, Error, Matrix, Result};

/// What a loss measured on a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Loss {
    /// The loss, averaged over the batch (over every element for [`mse`]).
    pub mean: f64,
    /// Samples in the batch.
    pub samples: usize,
    /// [`softmax_cross_entropy`]: samples whose largest logit (the first of equal ones) is
    /// their label. `None` for the regression losses.
    pub correct: Option<usize>,
}

impl Loss {
    /// The fraction of samples classified correctly (cross-entropy only).
    pub fn accuracy(&self) -> Option<f64> {
        self.correct.map(|c| c as f64 / self.samples as f64)
    }
}

/// The mean soft-max cross-entropy of `logits` against `labels` (one class index per sample),
/// PyTorch's `cross_entropy(logits, labels)`; writes its gradient with respect to the logits,
/// `(softmax(z) - onehot(label)) / B`, into `d_logits` and counts the correct predictions.
///
/// Stable for any finite logits: each sample's log-sum-exp is taken after subtracting its
/// largest logit, so no `exp` overflows. Errors (nothing written): `labels.len() != B`, a label
/// `>= N`, a non-finite logit, an empty batch or no classes.
///
/// ```
/// use conv_runtime::{loss, Matrix};
///
/// # fn main() -> conv_runtime::Result<()> {
/// let logits = Matrix::<f32, 2, 3>::from_vec(vec![2.0, 0.5, -1.0, 0.0, 0.0, 3.0])?;
/// let mut d_logits = Matrix::zeros();
/// let loss = loss::softmax_cross_entropy(&logits, &[0, 1], &mut d_logits)?;
/// assert_eq!(loss.correct, Some(1)); // sample 1's largest logit is class 2, not its label 1
/// assert!((loss.mean - 1.668117).abs() < 1e-6);
/// # Ok(())
/// # }
/// ```
pub fn softmax_cross_entropy<T: Element, const B: usize, const N: usize>(
    logits: &Matrix<T, B, N>,
    labels: &[usize],
    d_logits: &mut Matrix<T, B, N>,
) -> Result<Loss> {
    let operation = "loss::softmax_cross_entropy";
    if N == 0 {
        return Err(Error::new(operation, "the logits have no classes"));
    }
    let batch = batch_size(operation, B)?;
    same_len(operation, "labels", labels.len(), B)?;
    if let Some((i, &label)) = labels.iter().enumerate().find(|&(_, &l)| l >= N) {
        return Err(Error::new(
            operation,
            format!("label {label} of sample {i} is not one of the {N} classes"),
        ));
    }
    all_finite(operation, "logit", logits.as_slice(), N)?;

    let mut total = 0.0;
    let mut correct = 0;
    let d_logits = d_logits.as_mut_slice();
    for (i, (z, &label)) in logits.rows().zip(labels).enumerate() {
        // The largest logit, and where it is first (the prediction, as `argmax`).
        let (predicted, max) = z
            .iter()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |best, (k, v)| {
                let v = v.to_f64();
                if v > best.1 {
                    (k, v)
                } else {
                    best
                }
            });
        correct += usize::from(predicted == label);
        let sum: f64 = z.iter().map(|&v| (v.to_f64() - max).exp()).sum();
        let log_sum_exp = max + sum.ln();
        total += log_sum_exp - z[label].to_f64();
        let d_z = &mut d_logits[i * N..(i + 1) * N];
        for (k, (d, &v)) in d_z.iter_mut().zip(z).enumerate() {
            let p = (v.to_f64() - log_sum_exp).exp();
            let target = if k == label { 1.0 } else { 0.0 };
            *d = T::from_f64((p - target) / batch);
        }
    }
    Ok(Loss {
        mean: total / batch,
        samples: B,
        correct: Some(correct),
    })
}

/// The mean squared error between `output` and `target` over every element, PyTorch's
/// `mse_loss(output, target)`; writes its gradient with respect to the output,
/// `2 (output - target) / (B * C)`, into `d_output`.
///
/// Errors (nothing written): a non-finite value in `output` or `target`, an empty matrix.
pub fn mse<T: Element, const B: usize, const C: usize>(
    output: &Matrix<T, B, C>,
    target: &Matrix<T, B, C>,
    d_output: &mut Matrix<T, B, C>,
) -> Result<Loss> {
    let operation = "loss::mse";
    batch_size(operation, B)?;
    let count = B * C;
    if count == 0 {
        return Err(Error::new(operation, "the output has no elements"));
    }
    all_finite(operation, "output", output.as_slice(), C)?;
    all_finite(operation, "target", target.as_slice(), C)?;

    let count = count as f64;
    let mut total = 0.0;
    let pairs = output.as_slice().iter().zip(target.as_slice());
    for (d, (&o, &t)) in d_output.as_mut_slice().iter_mut().zip(pairs) {
        let diff = o.to_f64() - t.to_f64();
        total += diff * diff;
        *d = T::from_f64(2.0 * diff / count);
    }
    Ok(Loss {
        mean: total / count,
        samples: B,
        correct: None,
    })
}

/// DQN's temporal-difference loss: the Huber loss (smooth L1, beta = 1) between the Q-value of
/// the action each sample took and its target, averaged over the batch — PyTorch's
/// `smooth_l1_loss(q.gather(1, actions), targets)`. With `d = q[i][actions[i]] - targets[i]`, a
/// sample's loss is `d^2 / 2` where `|d| < 1` and `|d| - 1/2` elsewhere; its gradient,
/// `clamp(d, -1, 1) / B`, goes to the Q-value of the action taken, and every other entry of
/// `d_q` is zero (the actions not taken had no part in the loss).
///
/// `targets` (`r + gamma max_a' Q'(s', a')`, computed by the caller) may be in the network's
/// element type or in f64. Errors (nothing written): `actions` or `targets` not `B` long, an
/// action `>= A`, a non-finite Q-value or target, an empty batch.
pub fn huber_on_actions<T: Element, U: Element, const B: usize, const A: usize>(
    q: &Matrix<T, B, A>,
    actions: &[usize],
    targets: &[U],
    d_q: &mut Matrix<T, B, A>,
) -> Result<Loss> {
    let operation = "loss::huber_on_actions";
    let batch = batch_size(operation, B)?;
    same_len(operation, "actions", actions.len(), B)?;
    same_len(operation, "targets", targets.len(), B)?;
    if let Some((i, &action)) = actions.iter().enumerate().find(|&(_, &a)| a >= A) {
        return Err(Error::new(
            operation,
            format!("action {action} of sample {i} is not one of the {A} actions"),
        ));
    }
    all_finite(operation, "Q-value", q.as_slice(), A)?;
    all_finite(operation, "target", targets, 1)?;

    let mut total = 0.0;
    let d_q = d_q.as_mut_slice();
    d_q.fill(T::zero());
    for (i, (row, (&action, &target))) in q.rows().zip(actions.iter().zip(targets)).enumerate() {
        let d = row[action].to_f64() - target.to_f64();
        let (loss, grad) = if d.abs() < 1.0 {
            (0.5 * d * d, d)
        } else {
            (d.abs() - 0.5, d.signum())
        };
        total += loss;
        d_q[i * A + action] = T::from_f64(grad / batch);
    }
    Ok(Loss {
        mean: total / batch,
        samples: B,
        correct: None,
    })
}

/// The batch size as the mean's divisor; a mean over no samples is undefined (PyTorch: NaN).
fn batch_size(operation: &str, batch: usize) -> Result<f64> {
    if batch == 0 {
        return Err(Error::new(operation, "the batch is empty"));
    }
    Ok(batch as f64)
}

fn same_len(operation: &str, what: &str, len: usize, batch: usize) -> Result<()> {
    if len != batch {
        return Err(Error::new(
            operation,
            format!("{len} {what} for a batch of {batch}"),
        ));
    }
    Ok(())
}

/// Fails at the first NaN or infinity of `values` (rows of `columns`), naming its position.
fn all_finite<T: Element>(operation: &str, what: &str, values: &[T], columns: usize) -> Result<()> {
    let Some(at) = values.iter().position(|v| !v.to_f64().is_finite()) else {
        return Ok(());
    };
    let (sample, value) = (at / columns, values[at].to_f64());
    let what = if columns == 1 {
        what.to_string()
    } else {
        format!("{what} {}", at % columns)
    };
    Err(Error::new(
        operation,
        format!("{what} of sample {sample} is {value}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bf16, f16, Rng};

    const LOGITS: [f64; 12] = [
        0.5, -1.25, 2.0, 0.0, //
        3.0, 3.0, -2.5, 1.0, //
        -0.75, 0.25, 0.125, -4.0,
    ];

    fn close(what: &str, got: f64, want: f64, tol: f64) {
        assert!(
            (got - want).abs() <= tol * want.abs().max(1.0),
            "{what}: {got} vs {want}"
        );
    }

    /// The soft-max cross-entropy straight from its definition, `-ln(e^z_y / sum_k e^z_k)`,
    /// without the max shift (fine for the moderate logits it is given).
    fn cross_entropy_reference(z: &[f64], labels: &[usize], n: usize) -> (f64, Vec<f64>) {
        let b = labels.len() as f64;
        let mut loss = 0.0;
        let mut grad = vec![0.0; z.len()];
        for (i, &y) in labels.iter().enumerate() {
            let row = &z[i * n..(i + 1) * n];
            let e: Vec<f64> = row.iter().map(|v| v.exp()).collect();
            let s: f64 = e.iter().sum();
            loss -= (e[y] / s).ln();
            for k in 0..n {
                grad[i * n + k] = (e[k] / s - f64::from(u8::from(k == y))) / b;
            }
        }
        (loss / b, grad)
    }

    fn mse_reference(o: &[f64], t: &[f64]) -> (f64, Vec<f64>) {
        let n = o.len() as f64;
        let loss = o.iter().zip(t).map(|(o, t)| (o - t).powi(2)).sum::<f64>() / n;
        (
            loss,
            o.iter().zip(t).map(|(o, t)| 2.0 * (o - t) / n).collect(),
        )
    }

    /// Smooth L1 (beta 1) of the taken actions' Q-values, with PyTorch's piecewise derivative.
    fn huber_reference(q: &[f64], actions: &[usize], targets: &[f64], a: usize) -> (f64, Vec<f64>) {
        let b = actions.len() as f64;
        let mut loss = 0.0;
        let mut grad = vec![0.0; q.len()];
        for (i, (&act, &t)) in actions.iter().zip(targets).enumerate() {
            let d = q[i * a + act] - t;
            loss += if d.abs() < 1.0 {
                d * d / 2.0
            } else {
                d.abs() - 0.5
            };
            grad[i * a + act] = d.clamp(-1.0, 1.0) / b;
        }
        (loss / b, grad)
    }

    fn to_f64<T: Element>(values: &[T]) -> Vec<f64> {
        values.iter().map(|v| v.to_f64()).collect()
    }

    /// Values PyTorch 2.15 computed in float64 (`F.cross_entropy`, `F.mse_loss`,
    /// `F.smooth_l1_loss` on `q.gather(1, actions)`, then `.backward()`).
    #[test]
    fn match_pytorch() -> Result<()> {
        let z = Matrix::<f64, 3, 4>::from_vec(LOGITS.to_vec())?;
        let mut d = Matrix::zeros();

        let loss = softmax_cross_entropy(&z, &[2, 1, 3], &mut d)?;
        close("cross-entropy", loss.mean, 2.0541501327464067, 1e-15);
        // Sample 1's logits tie between classes 0 and 1: the first wins, so label 1 misses.
        assert_eq!((loss.correct, loss.samples), (Some(1), 3));
        let torch = [
            0.05323118334403608,
            0.009250192644226803,
            -0.09476772073920521,
            0.032286344750942345,
            0.15580531789177898,
            -0.17752801544155433,
            0.0006367407231209366,
            0.02108595682665438,
            0.05414831898707524,
            0.14719039154417052,
            0.1298950646279443,
            -0.33123377515919006,
        ];
        for (k, (&g, t)) in d.as_slice().iter().zip(torch).enumerate() {
            close(&format!("d_logits[{k}]"), g, t, 1e-14);
        }

        let target = Matrix::<f64, 3, 4>::from_vec(vec![
            0.0, -1.0, 2.5, 0.25, 1.0, 3.5, -2.0, 1.0, -0.5, 0.0, 0.0, -3.0,
        ])?;
        let loss = mse(&z, &target, &mut d)?;
        close("mse", loss.mean, 0.5221354166666666, 1e-15);
        assert_eq!(loss.correct, None);
        let twelfth = 1.0 / 12.0;
        let torch = [
            2.0, -1.0, -2.0, -1.0, 8.0, -2.0, -2.0, 0.0, -1.0, 1.0, 0.5, -4.0,
        ];
        for (k, (&g, t)) in d.as_slice().iter().zip(torch).enumerate() {
            close(&format!("d_output[{k}]"), g, t * twelfth / 2.0, 1e-15);
        }

        // Differences -1.5 (linear part), 0.5 (quadratic) and 1.0 (the seam).
        let loss = huber_on_actions(&z, &[0, 1, 3], &[2.0, 2.5, -5.0], &mut d)?;
        close("huber", loss.mean, 0.5416666666666666, 1e-15);
        let third = 1.0 / 3.0;
        let mut torch = [0.0; 12];
        (torch[0], torch[5], torch[11]) = (-third, third / 2.0, third);
        assert_eq!(d.as_slice(), torch);
        Ok(())
    }

    /// Random batches against the references, and the gradients against central differences
    /// of the loss itself.
    #[test]
    fn gradients_match_references_and_finite_differences() -> Result<()> {
        const B: usize = 4;
        const N: usize = 5;
        let mut rng = Rng::seed_from_u64(11);
        let z = Matrix::<f64, B, N>::from_fn(|_| 2.0 * rng.normal());
        let target = Matrix::<f64, B, N>::from_fn(|_| rng.normal());
        let labels = [3, 0, 4, 4];
        let actions = [1, 4, 0, 1];
        // |q - target| is 2.5, 0.4, 0.3 and 1.7: both sides of the seam, away from it.
        let targets: Vec<f64> = (0..B)
            .map(|i| z.row(i)[actions[i]] - [2.5, -0.4, 0.3, -1.7][i])
            .collect();

        type LossFn<'a> = &'a dyn Fn(&Matrix<f64, B, N>, &mut Matrix<f64, B, N>) -> Result<Loss>;
        /// A loss, and its reference loss and gradient.
        type Case<'a> = (&'a str, LossFn<'a>, (f64, Vec<f64>));
        let ce =
            |z: &Matrix<f64, B, N>, d: &mut Matrix<f64, B, N>| softmax_cross_entropy(z, &labels, d);
        let sq = |z: &Matrix<f64, B, N>, d: &mut Matrix<f64, B, N>| mse(z, &target, d);
        let hub = |z: &Matrix<f64, B, N>, d: &mut Matrix<f64, B, N>| {
            huber_on_actions(z, &actions, &targets, d)
        };
        let cases: [Case; 3] = [
            (
                "cross-entropy",
                &ce,
                cross_entropy_reference(z.as_slice(), &labels, N),
            ),
            ("mse", &sq, mse_reference(z.as_slice(), target.as_slice())),
            (
                "huber",
                &hub,
                huber_reference(z.as_slice(), &actions, &targets, N),
            ),
        ];
        for (name, loss, (ref_loss, ref_grad)) in cases {
            let mut d = Matrix::zeros();
            close(name, loss(&z, &mut d)?.mean, ref_loss, 1e-14);
            let eps = 1e-6;
            let mut scratch = Matrix::zeros();
            for (k, (&analytic, &reference)) in d.as_slice().iter().zip(&ref_grad).enumerate() {
                close(&format!("{name} d[{k}]"), analytic, reference, 1e-13);
                let (mut up, mut down) = (z.clone(), z.clone());
                up.as_mut_slice()[k] += eps;
                down.as_mut_slice()[k] -= eps;
                let numeric =
                    (loss(&up, &mut scratch)?.mean - loss(&down, &mut scratch)?.mean) / (2.0 * eps);
                assert!(
                    (numeric - analytic).abs() < 1e-8,
                    "{name} d[{k}]: {analytic} vs numeric {numeric}"
                );
            }
        }
        Ok(())
    }

    /// f32 and the half types: inputs widen exactly and the f64 result is rounded once, so
    /// each gradient element is within half an ulp of the reference on the same inputs.
    #[test]
    fn half_types_round_the_f64_result_once() -> Result<()> {
        // (unit roundoff, smallest subnormal / 2) per type.
        check_rounding::<f32>(2f64.powi(-24), 2f64.powi(-150))?;
        check_rounding::<f16>(2f64.powi(-11), 2f64.powi(-25))?;
        check_rounding::<bf16>(2f64.powi(-8), 2f64.powi(-134))
    }

    fn check_rounding<T: Element>(unit: f64, tiny: f64) -> Result<()> {
        const B: usize = 3;
        const N: usize = 7;
        let mut rng = Rng::seed_from_u64(5);
        let z = Matrix::<T, B, N>::from_fn(|_| T::from_f64(3.0 * rng.normal()));
        let t = Matrix::<T, B, N>::from_fn(|_| T::from_f64(rng.normal()));
        let (labels, actions) = ([6, 0, 2], [1, 6, 3]);
        let targets: Vec<T> = (0..B).map(|_| T::from_f64(2.0 * rng.normal())).collect();
        let (zf, tf) = (to_f64(z.as_slice()), to_f64(t.as_slice()));
        let name = std::any::type_name::<T>();
        let mut d = Matrix::<T, B, N>::zeros();
        let within = |what: &str, d: &Matrix<T, B, N>, reference: &[f64]| {
            for (k, (&g, &r)) in d.as_slice().iter().zip(reference).enumerate() {
                let g = g.to_f64();
                assert!(
                    (g - r).abs() <= unit * r.abs() + tiny,
                    "{name} {what} d[{k}]: {g} vs {r}"
                );
            }
        };

        let (loss, grad) = cross_entropy_reference(&zf, &labels, N);
        close(
            name,
            softmax_cross_entropy(&z, &labels, &mut d)?.mean,
            loss,
            1e-14,
        );
        within("cross-entropy", &d, &grad);
        let (loss, grad) = mse_reference(&zf, &tf);
        close(name, mse(&z, &t, &mut d)?.mean, loss, 1e-14);
        within("mse", &d, &grad);
        let (loss, grad) = huber_reference(&zf, &actions, &to_f64(&targets), N);
        close(
            name,
            huber_on_actions(&z, &actions, &targets, &mut d)?.mean,
            loss,
            1e-14,
        );
        within("huber", &d, &grad);
        Ok(())
    }

    #[test]
    fn cross_entropy_is_stable_for_large_logits() -> Result<()> {
        let z = Matrix::<f32, 2, 3>::from_vec(vec![1000.0, 0.0, -1000.0, -3e38, -3e38, 3e38])?;
        let mut d = Matrix::zeros();
        let loss = softmax_cross_entropy(&z, &[1, 2], &mut d)?;
        // Sample 0: 1000 + ln(1 + e^-1000 + e^-2000) - 0; sample 1: 0.
        close("loss", loss.mean, 500.0, 1e-15);
        assert_eq!(d.as_slice(), [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(loss.accuracy(), Some(0.5));
        Ok(())
    }

    /// Every error names the loss and leaves the gradient as it was, stamp included.
    #[test]
    fn bad_inputs_are_errors_and_write_nothing() {
        let z = Matrix::<f32, 2, 3>::from_vec(vec![0.5, 1.0, -1.0, 2.0, 0.0, 1.0]).unwrap();
        let mut nan = z.clone();
        nan.as_mut_slice()[4] = f32::NAN;
        let mut inf = z.clone();
        inf.as_mut_slice()[2] = f32::NEG_INFINITY;
        let mut d = Matrix::<f32, 2, 3>::from_fn(|_| 7.0);
        let untouched = d.clone();
        let expect =
            |result: Result<Loss>, d: &Matrix<f32, 2, 3>, operation: &str, reason: &str| {
                let e = result.unwrap_err();
                assert_eq!(e.operation, operation);
                assert!(e.reason.contains(reason), "{e}");
                assert_eq!(d.stamp(), untouched.stamp(), "{e}");
            };
        let ce = "loss::softmax_cross_entropy";
        expect(
            softmax_cross_entropy(&z, &[0, 3], &mut d),
            &d,
            ce,
            "label 3 of sample 1 is not one of the 3 classes",
        );
        expect(
            softmax_cross_entropy(&z, &[0], &mut d),
            &d,
            ce,
            "1 labels for a batch of 2",
        );
        expect(
            softmax_cross_entropy(&nan, &[0, 1], &mut d),
            &d,
            ce,
            "logit 1 of sample 1 is NaN",
        );
        expect(
            softmax_cross_entropy(&inf, &[0, 1], &mut d),
            &d,
            ce,
            "logit 2 of sample 0 is -inf",
        );
        expect(
            mse(&z, &nan, &mut d),
            &d,
            "loss::mse",
            "target 1 of sample 1 is NaN",
        );
        let hu = "loss::huber_on_actions";
        expect(
            huber_on_actions(&z, &[0, 3], &[1.0, 1.0], &mut d),
            &d,
            hu,
            "action 3 of sample 1 is not one of the 3 actions",
        );
        expect(
            huber_on_actions(&z, &[0, 1], &[1.0], &mut d),
            &d,
            hu,
            "1 targets for a batch of 2",
        );
        expect(
            huber_on_actions(&z, &[0, 1], &[1.0, f64::INFINITY], &mut d),
            &d,
            hu,
            "target of sample 1 is inf",
        );
        expect(
            huber_on_actions(&inf, &[0, 1], &[1.0, 1.0], &mut d),
            &d,
            hu,
            "Q-value 2 of sample 0 is -inf",
        );
        assert_eq!(d, untouched);

        let e = softmax_cross_entropy(&Matrix::<f32, 0, 3>::zeros(), &[], &mut Matrix::zeros())
            .unwrap_err();
        assert!(e.reason.contains("the batch is empty"), "{e}");
        let e = softmax_cross_entropy(&Matrix::<f32, 2, 0>::zeros(), &[0, 0], &mut Matrix::zeros())
            .unwrap_err();
        assert!(e.reason.contains("no classes"), "{e}");
    }
}
