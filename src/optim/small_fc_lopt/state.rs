//! Per-tensor optimizer state (momenta, rms, Adafactor factors), its flat CUDA layout, and
//! save / load.

#[cfg(feature = "cuda")]
use super::cuda;
use super::{SmallFcLOpt, OP};
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// The Adafactor accumulators of one tensor.
#[derive(Debug, Clone)]
pub(super) enum Factors {
    /// Rank >= 2: `row.get(k)` is the k-th accumulator of means over axis `d0` (the largest,
    /// kept with size 1), `col.get(k)` of means over `d1` (the second largest). The three are
    /// stacked along a leading axis so one op updates all of them.
    Matrix {
        d0: usize,
        d1: usize,
        row: Tensor,
        col: Tensor,
    },
    /// Rank 0 and 1: one accumulator per element.
    Vector { full: [Tensor; 3] },
}

#[derive(Debug, Clone)]
pub(super) struct TensorState {
    /// The key of this state in saved files.
    pub(super) name: String,
    pub(super) var: Var,
    /// The shape the optimizer works in: the variable's, with rank 0 as `[1]`.
    pub(super) shape: Vec<usize>,
    pub(super) momentum: [Tensor; 3],
    pub(super) rms: Tensor,
    pub(super) factors: Factors,
}

/// The axes of the largest and second-largest dims (ties: the later axis counts as larger).
pub(super) fn factored_axes(shape: &[usize]) -> (usize, usize) {
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&a| (shape[a], a));
    (order[shape.len() - 1], order[shape.len() - 2])
}

impl TensorState {
    pub(super) fn new(name: String, var: Var) -> Result<Self> {
        let shape = if var.rank() == 0 {
            vec![1]
        } else {
            var.dims().to_vec()
        };
        let dev = var.device();
        let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev);
        let three = |shape: &[usize]| -> Result<[Tensor; 3]> {
            Ok([zeros(shape)?, zeros(shape)?, zeros(shape)?])
        };
        let factors = if shape.len() >= 2 {
            let (d0, d1) = factored_axes(&shape);
            let mut row_shape = shape.clone();
            row_shape[d0] = 1;
            let mut col_shape = shape.clone();
            col_shape[d1] = 1;
            let stacked = |shape: &[usize]| zeros(&[&[3], shape].concat());
            Factors::Matrix {
                d0,
                d1,
                row: stacked(&row_shape)?,
                col: stacked(&col_shape)?,
            }
        } else {
            Factors::Vector {
                full: three(&shape)?,
            }
        };
        Ok(Self {
            momentum: three(&shape)?,
            rms: zeros(&shape)?,
            factors,
            shape,
            name,
            var,
        })
    }
}

#[cfg(feature = "cuda")]
impl TensorState {
    /// The states of `vars` as views into one set of flat device buffers.
    pub(super) fn new_flat(
        vars: Vec<(String, Var)>, dev: &Device,
    ) -> Result<(cuda::DeviceState, Vec<Self>)> {
        let shapes: Vec<_> = vars
            .iter()
            .map(|(_, v)| {
                let shape = if v.rank() == 0 {
                    vec![1]
                } else {
                    v.dims().to_vec()
                };
                let axes = (shape.len() >= 2).then(|| factored_axes(&shape));
                (shape, axes)
            })
            .collect();
        let flat = cuda::DeviceState::new(&shapes, dev)?;
        let mut states = Vec::with_capacity(vars.len());
        for (((name, var), (shape, axes)), slots) in vars.into_iter().zip(shapes).zip(&flat.slots) {
            let n = slots.n;
            let plane = |buf: &Tensor, at: usize| buf.narrow(0, at, n)?.reshape(shape.as_slice());
            let factors = match (&slots.kind, axes) {
                (
                    cuda::SlotKind::Matrix {
                        row,
                        row_shape,
                        col,
                        col_shape,
                    },
                    Some((d0, d1)),
                ) => {
                    let stacked = |buf: &Tensor, at: usize, shape: &[usize]| {
                        let len: usize = shape.iter().product();
                        buf.narrow(0, at, 3 * len)?.reshape([&[3], shape].concat())
                    };
                    Factors::Matrix {
                        d0,
                        d1,
                        row: stacked(&flat.row, *row, row_shape)?,
                        col: stacked(&flat.col, *col, col_shape)?,
                    }
                }
                (cuda::SlotKind::Vector { full }, None) => Factors::Vector {
                    full: [
                        plane(&flat.full, *full)?,
                        plane(&flat.full, full + n)?,
                        plane(&flat.full, full + 2 * n)?,
                    ],
                },
                _ => bail!("{OP}: internal error, flat state layout does not match the tensor"),
            };
            let e = slots.elem;
            states.push(Self {
                momentum: [
                    plane(&flat.elem, e)?,
                    plane(&flat.elem, e + n)?,
                    plane(&flat.elem, e + 2 * n)?,
                ],
                rms: plane(&flat.elem, e + 3 * n)?,
                factors,
                shape,
                name,
                var,
            });
        }
        Ok((flat, states))
    }

    /// Overwrites this state's values (views into the flat buffers) with `src`'s.
    pub(super) fn copy_from(&self, src: &TensorState) -> Result<()> {
        let pairs: Vec<(&Tensor, &Tensor)> = match (&self.factors, &src.factors) {
            (Factors::Matrix { row, col, .. }, Factors::Matrix { row: r, col: c, .. }) => {
                vec![(row, r), (col, c)]
            }
            (Factors::Vector { full }, Factors::Vector { full: f }) => full.iter().zip(f).collect(),
            _ => bail!("{OP}: internal error, state kinds differ"),
        };
        let momenta = self.momentum.iter().zip(&src.momentum);
        for (dst, src) in pairs
            .into_iter()
            .chain(momenta)
            .chain(std::iter::once((&self.rms, &src.rms)))
        {
            dst.flatten_all()?
                .slice_set(&src.flatten_all()?.contiguous()?, 0, 0)?;
        }
        Ok(())
    }
}

/// The three views of a stacked `[3, ...]` tensor.
pub(super) fn unstack(t: &Tensor) -> Result<[Tensor; 3]> {
    Ok([t.get(0)?, t.get(1)?, t.get(2)?])
}

impl SmallFcLOpt {
    /// Writes the optimizer state to a safetensors file: the step counter (`steps`) and every
    /// accumulator of every variable, keyed by the variable's name (`{name}.momentum.{k}`,
    /// `{name}.rms`, `{name}.row.{k}` / `{name}.col.{k}` for matrices, `{name}.full.{k}`
    /// otherwise; names are positions for [`candle_nn::Optimizer::new`]).
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        map.insert(
            "steps".into(),
            Tensor::new(&[self.steps as i64], &Device::Cpu)?,
        );
        for s in &self.states {
            for (key, tensor) in s.entries()? {
                map.insert(key, tensor);
            }
        }
        candle_core::safetensors::save(&map, path)
    }

    /// Bytes of optimizer state held for the variables (f32 momenta, rms accumulator and
    /// Adafactor factors; the MLP's weights and the step counter not counted).
    pub fn state_bytes(&self) -> usize {
        self.states
            .iter()
            .map(|s| {
                let factors = match &s.factors {
                    Factors::Matrix { row, col, .. } => row.elem_count() + col.elem_count(),
                    Factors::Vector { full } => full.iter().map(Tensor::elem_count).sum(),
                };
                let accumulators: usize = s.momentum.iter().map(Tensor::elem_count).sum();
                (accumulators + s.rms.elem_count() + factors) * std::mem::size_of::<f32>()
            })
            .sum()
    }

    /// Restores a state written by [`SmallFcLOpt::save_state`] onto the variables of the same
    /// names, whatever their order. The file must hold exactly this optimizer's variable names
    /// with the same shapes: otherwise the error names the first mismatch (a missing or extra
    /// variable, or a tensor of another shape) and nothing changes.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let dev = self.params.mlp.device().clone();
        let map = candle_core::safetensors::load(path, &dev)?;
        let steps = match map.get("steps") {
            Some(t) if t.elem_count() == 1 => {
                t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()?[0]
            }
            Some(t) => bail!(
                "{OP}: state file's `steps` has shape {:?}, expected one element",
                t.dims()
            ),
            None => bail!("{OP}: state file has no `steps`"),
        };
        if steps < 0 {
            bail!("{OP}: state file's `steps` is negative ({steps})");
        }
        let mut stored: Vec<&str> = map.keys().filter_map(|k| k.strip_suffix(".rms")).collect();
        stored.sort_unstable();
        let ours: std::collections::HashSet<&str> =
            self.states.iter().map(|s| s.name.as_str()).collect();
        if let Some(extra) = stored.iter().find(|name| !ours.contains(*name)) {
            bail!("{OP}: state file holds variable `{extra}`, which this optimizer does not have");
        }
        let mut restored = Vec::with_capacity(self.states.len());
        for s in &self.states {
            restored.push(s.restored_from(&map)?);
        }
        #[cfg(feature = "cuda")]
        if self.flat.is_some() {
            // The states are views into the flat buffers the kernels update: copy into them.
            for (dst, src) in self.states.iter().zip(&restored) {
                dst.copy_from(src)?;
            }
            self.steps = steps as u64;
            return Ok(());
        }
        self.states = restored;
        self.steps = steps as u64;
        Ok(())
    }
}

impl TensorState {
    /// This state's tensors under their keys in a saved file.
    fn entries(&self) -> Result<Vec<(String, Tensor)>> {
        let name = &self.name;
        let mut out = Vec::with_capacity(10);
        for (k, m) in self.momentum.iter().enumerate() {
            out.push((format!("{name}.momentum.{k}"), m.clone()));
        }
        out.push((format!("{name}.rms"), self.rms.clone()));
        match &self.factors {
            Factors::Matrix { row, col, .. } => {
                for (k, (r, c)) in unstack(row)?.iter().zip(&unstack(col)?).enumerate() {
                    out.push((format!("{name}.row.{k}"), r.clone()));
                    out.push((format!("{name}.col.{k}"), c.clone()));
                }
            }
            Factors::Vector { full } => {
                for (k, f) in full.iter().enumerate() {
                    out.push((format!("{name}.full.{k}"), f.clone()));
                }
            }
        }
        Ok(out)
    }

    /// A copy of this state with every tensor taken from `map` (a loaded state file), each
    /// checked for its shape and dtype.
    fn restored_from(&self, map: &HashMap<String, Tensor>) -> Result<Self> {
        let name = &self.name;
        if !map.contains_key(&format!("{name}.rms")) {
            bail!(
                "{OP}: state file has no state for variable `{name}` (shape {:?})",
                self.var.dims()
            );
        }
        let take = |what: String, like: &Tensor| -> Result<Tensor> {
            let Some(t) = map.get(&what) else {
                bail!("{OP}: state file has no tensor `{what}` for variable `{name}`");
            };
            if t.dims() != like.dims() || t.dtype() != DType::F32 {
                bail!(
                    "{OP}: state tensor `{what}` is {:?} {:?}, but variable `{name}` (shape {:?}) needs {:?} f32",
                    t.dims(),
                    t.dtype(),
                    self.var.dims(),
                    like.dims()
                );
            }
            Ok(t.clone())
        };
        let three = |what: &str, like: &[Tensor; 3]| -> Result<[Tensor; 3]> {
            Ok([
                take(format!("{name}.{what}.0"), &like[0])?,
                take(format!("{name}.{what}.1"), &like[1])?,
                take(format!("{name}.{what}.2"), &like[2])?,
            ])
        };
        let factors = match &self.factors {
            Factors::Matrix { d0, d1, row, col } => Factors::Matrix {
                d0: *d0,
                d1: *d1,
                row: Tensor::stack(&three("row", &unstack(row)?)?, 0)?,
                col: Tensor::stack(&three("col", &unstack(col)?)?, 0)?,
            },
            Factors::Vector { full } => Factors::Vector {
                full: three("full", full)?,
            },
        };
        Ok(Self {
            name: name.clone(),
            var: self.var.clone(),
            shape: self.shape.clone(),
            momentum: three("momentum", &self.momentum)?,
            rms: take(format!("{name}.rms"), &self.rms)?,
            factors,
        })
    }
}
