//! Dtype dispatch, written once for every op: a macro binds the typed slice of a storage to a
//! name and expands the body once per supported float dtype.

/// `match_variants!(Enum, value, [V1, V2, ..], |slice| body, pattern => fallback)`: a
/// match that binds the payload of each listed variant to `slice` and expands `body` for each,
/// then `fallback` for anything else. The dispatch macros below are written with it.
macro_rules! match_variants {
    ($enum:ident, $value:expr, [$($variant:ident),+], |$slice:ident| $body:expr,
     $other:pat => $fallback:expr) => {{
        match $value {
            $($enum::$variant($slice) => $body,)+
            $other => $fallback,
        }
    }};
}
pub(crate) use match_variants;

/// `with_float_cpu!(op_name, storage, |slice| body)`: `slice` is the `&Vec<T>` (or `&mut Vec<T>`)
/// of an f32, f16, bf16 or f64 [`candle_core::CpuStorage`]; other dtypes are an error naming the op.
macro_rules! with_float_cpu {
    ($op:expr, $storage:expr, |$slice:ident| $body:expr) => {{
        use candle_core::CpuStorage as S;
        $crate::dispatch::match_variants!(
            S, $storage, [F32, F16, BF16, F64], |$slice| $body,
            other => candle_core::bail!(
                "{}: unsupported dtype {:?} (expected f32, f16, bf16 or f64)",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            )
        )
    }};
}
pub(crate) use with_float_cpu;

/// `with_cpu_gemm_pair!(op_name, a, b, |a, b| body)`: `a` and `b` are the `&Vec<T>` of two f32
/// or two f64 [`candle_core::CpuStorage`]s (the dtypes the CPU matrix products run in: the
/// public wrappers widen f16 / bf16 to f32 first); anything else is an internal error. With
/// `storage(|a, b| body)`, `body` is a `Vec<T>` returned as the `CpuStorage` of its type.
macro_rules! with_cpu_gemm_pair {
    ($op:expr, $a_storage:expr, $b_storage:expr, storage(|$a:ident, $b:ident| $body:expr)) => {
        $crate::dispatch::with_cpu_gemm_pair!($op, $a_storage, $b_storage, |$a, $b| {
            candle_core::WithDType::to_cpu_storage_owned($body)
        })
    };
    ($op:expr, $a_storage:expr, $b_storage:expr, |$a:ident, $b:ident| $body:expr) => {{
        use candle_core::CpuStorage as S;
        match ($a_storage, $b_storage) {
            (S::F32($a), S::F32($b)) => $body,
            (S::F64($a), S::F64($b)) => $body,
            _ => candle_core::bail!("{}: internal error, unexpected dtypes on the CPU", $op),
        }
    }};
}
pub(crate) use with_cpu_gemm_pair;

/// `with_float_cuda!(op_name, storage.slice, |slice| body)`: `slice` is the `CudaSlice<T>` of an
/// f32, f16 or bf16 `CudaStorageSlice` (by reference or mutable reference, following the
/// expression given); other dtypes are an error naming the op. The public wrappers check dtypes
/// first with a message naming the dtype, so this arm is a backstop.
#[cfg(feature = "cuda")]
macro_rules! with_float_cuda {
    ($op:expr, $slice_enum:expr, |$slice:ident| $body:expr) => {{
        use candle_core::cuda_backend::CudaStorageSlice as S;
        $crate::dispatch::match_variants!(
            S, $slice_enum, [F32, F16, BF16], |$slice| $body,
            _ => candle_core::bail!("{}: unsupported dtype on CUDA (expected f32, f16 or bf16)", $op)
        )
    }};
}
#[cfg(feature = "cuda")]
pub(crate) use with_float_cuda;

/// `with_float_cuda_pair!(op_name, a.slice, b.slice, |a, b| body)`: [`with_float_cuda`] for two
/// operands of one dtype (the matmul-core ops); a mixed pair is an error naming the op.
#[cfg(feature = "cuda")]
macro_rules! with_float_cuda_pair {
    ($op:expr, $a_enum:expr, $b_enum:expr, |$a:ident, $b:ident| $body:expr) => {{
        use candle_core::cuda_backend::CudaStorageSlice as S;
        match ($a_enum, $b_enum) {
            (S::F32($a), S::F32($b)) => $body,
            (S::F16($a), S::F16($b)) => $body,
            (S::BF16($a), S::BF16($b)) => $body,
            _ => candle_core::bail!(
                "{}: unsupported dtype on CUDA (expected f32, f16 or bf16, the same for both operands)",
                $op
            ),
        }
    }};
}
#[cfg(feature = "cuda")]
pub(crate) use with_float_cuda_pair;

/// The operand checks every float op makes, written once: `main`'s dtype is f32, f16, bf16 or f64
/// (f64 on the CPU only), each of `same_dtype` has `main`'s dtype, and each of `same_dtype` and
/// `same_device` sits on `main`'s device. Operands are `(name, tensor)`, named in the errors.
pub(crate) fn check_float_operands(
    op: &str, main: (&str, &candle_core::Tensor), same_dtype: &[(&str, &candle_core::Tensor)],
    same_device: &[(&str, &candle_core::Tensor)],
) -> candle_core::Result<()> {
    use candle_core::{bail, DType};
    let (main_name, t) = main;
    for (name, other) in same_dtype {
        if other.dtype() != t.dtype() {
            bail!(
                "{op}: dtype mismatch, {main_name} is {:?} but {name} is {:?}",
                t.dtype(),
                other.dtype()
            );
        }
    }
    if !matches!(
        t.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::F64
    ) {
        bail!(
            "{op}: {main_name} has unsupported dtype {:?} (expected f32, f16, bf16 or f64)",
            t.dtype()
        );
    }
    for (name, other) in same_dtype.iter().chain(same_device) {
        if !t.device().same_device(other.device()) {
            bail!(
                "{op}: device mismatch, {main_name} is on {:?} but {name} is on {:?}",
                t.device().location(),
                other.device().location()
            );
        }
    }
    if t.device().is_cuda() && t.dtype() == DType::F64 {
        bail!("{op}: f64 is supported on the CPU only");
    }
    Ok(())
}

/// `with_type_of!(dtype, [F32 => f32, ..], T => body, other => fallback)`: `body` with the type
/// `T` bound to the Rust type listed for `dtype`; `fallback` (with `other` bound to the dtype)
/// for a dtype not listed. The one dtype-to-type dispatch of code generic over the element type
/// rather than over a storage.
#[cfg(feature = "cuda")]
macro_rules! with_type_of {
    ($dtype:expr, [$($variant:ident => $ty:ty),* $(,)?], $t:ident => $body:expr, $other:ident => $fallback:expr) => {{
        match $dtype {
            $(candle_core::DType::$variant => {
                type $t = $ty;
                $body
            })*
            $other => $fallback,
        }
    }};
}
#[cfg(feature = "cuda")]
pub(crate) use with_type_of;

/// `with_float_cuda_type!(op_name, dtype, T => body)`: `body` with the type `T` bound to the Rust
/// type of an f32, f16 or bf16 `dtype` (for code generic over the element type rather than over a
/// storage); other dtypes are an error naming the op.
#[cfg(feature = "cuda")]
macro_rules! with_float_cuda_type {
    ($op:expr, $dtype:expr, $t:ident => $body:expr) => {
        $crate::dispatch::with_type_of!(
            $dtype,
            [F32 => f32, F16 => half::f16, BF16 => half::bf16],
            $t => $body,
            other => candle_core::bail!(
                "{}: unsupported dtype {other:?} on CUDA (expected f32, f16 or bf16)",
                $op
            )
        )
    };
}
#[cfg(feature = "cuda")]
pub(crate) use with_float_cuda_type;

/// `mirrored_struct!(Type, bytes)`: `Type` is a `#[repr(C)]` struct mirrored by a CUDA struct
/// whose `static_assert` checks the same size; this asserts the Rust side's size at compile time.
/// `mirrored_struct!(Type, bytes, kernel_arg)` also implements cudarc's `DeviceRepr`, so that the
/// struct can be passed to a kernel by value (with the `cuda` feature).
macro_rules! mirrored_struct {
    ($t:ty, $bytes:expr) => {
        const _: () = assert!(std::mem::size_of::<$t>() == $bytes);
    };
    ($t:ty, $bytes:expr, kernel_arg) => {
        const _: () = assert!(std::mem::size_of::<$t>() == $bytes);
        // SAFETY: `#[repr(C)]` plain-old-data of its C mirror's size (asserted above).
        #[cfg(feature = "cuda")]
        unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for $t {}
    };
}
pub(crate) use mirrored_struct;
