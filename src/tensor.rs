//! Element types, memory tags and strided views over memory that kvreplay borrows.

use crate::error::{Error, Result};

/// Most dimensions a [`TensorView`] can have.
pub const MAX_DIMS: usize = 8;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    BF16,
    /// 32-bit signed integer (sequence ids, lengths, accepted counts).
    I32,
}

impl DType {
    /// The floating-point element types, in their C enum order.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// True for f32, f16 and bf16.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Short lowercase name: `f32`, `f16`, `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the memory behind a view lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory, read and written by the CPU backend.
    Host,
    /// CUDA device memory (any pointer the device can dereference in kernels of the
    /// context's device: `cudaMalloc`, `cuMemAlloc`, managed or mapped memory).
    Cuda,
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
        })
    }
}

/// A strided view over memory the caller owns: address, element type, memory kind,
/// shape and strides counted in elements (not bytes).
///
/// A view is only a description; creating one checks that it is well formed (dimensions,
/// alignment, no address overflow) but cannot check that the memory exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorView {
    addr: usize,
    dtype: DType,
    memory: MemoryKind,
    ndim: usize,
    shape: [usize; MAX_DIMS],
    strides: [isize; MAX_DIMS],
}

impl TensorView {
    /// Builds a view and checks it: at most [`MAX_DIMS`] dimensions, strides ≥ 0, the
    /// address aligned to the element size and non-NULL when the view holds elements, and
    /// the largest byte offset representable.
    pub fn new(
        addr: usize,
        dtype: DType,
        memory: MemoryKind,
        shape: &[usize],
        strides: &[isize],
    ) -> Result<Self> {
        if shape.len() > MAX_DIMS {
            return Err(Error::InvalidArgument(format!(
                "tensor has {} dimensions; at most {MAX_DIMS} are supported",
                shape.len()
            )));
        }
        if shape.len() != strides.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor has {} shape entries but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        let mut view = TensorView {
            addr,
            dtype,
            memory,
            ndim: shape.len(),
            shape: [1; MAX_DIMS],
            strides: [0; MAX_DIMS],
        };
        view.shape[..shape.len()].copy_from_slice(shape);
        view.strides[..strides.len()].copy_from_slice(strides);
        for (d, &s) in strides.iter().enumerate() {
            if s < 0 {
                return Err(Error::InvalidArgument(format!(
                    "tensor stride {s} in dimension {d} is negative; strides must be >= 0"
                )));
            }
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
            .ok_or_else(|| Error::InvalidArgument(format!("tensor shape {shape:?} overflows")))?;
        if numel > 0 {
            if addr == 0 {
                return Err(Error::NullArgument(format!(
                    "tensor data pointer is NULL but the tensor holds {numel} elements"
                )));
            }
            if addr % dtype.size() != 0 {
                return Err(Error::InvalidArgument(format!(
                    "tensor data pointer {addr:#x} is not aligned to its element size ({} bytes for {dtype})",
                    dtype.size()
                )));
            }
            let max_elem = view.max_element_offset().ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "tensor shape {shape:?} with strides {strides:?} overflows the address space"
                ))
            })?;
            let max_byte = max_elem
                .checked_mul(dtype.size())
                .and_then(|b| b.checked_add(dtype.size()))
                .filter(|&b| b <= isize::MAX as usize)
                .and_then(|b| addr.checked_add(b));
            if max_byte.is_none() {
                return Err(Error::InvalidArgument(format!(
                    "tensor shape {shape:?} with strides {strides:?} overflows the address space"
                )));
            }
        }
        Ok(view)
    }

    /// A row-major contiguous view.
    pub fn contiguous(
        addr: usize,
        dtype: DType,
        memory: MemoryKind,
        shape: &[usize],
    ) -> Result<Self> {
        let strides = contiguous_strides(shape);
        Self::new(addr, dtype, memory, shape, &strides[..shape.len()])
    }

    /// The address of element 0.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Where the memory lives.
    pub fn memory(&self) -> MemoryKind {
        self.memory
    }
    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape[..self.ndim]
    }
    /// The strides, in elements.
    pub fn strides(&self) -> &[isize] {
        &self.strides[..self.ndim]
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// Offset in elements of the last element (None on overflow); 0 for an empty view.
    pub fn max_element_offset(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(0);
        }
        self.shape()
            .iter()
            .zip(self.strides())
            .try_fold(0usize, |acc, (&n, &s)| {
                (n - 1)
                    .checked_mul(s as usize)
                    .and_then(|x| acc.checked_add(x))
            })
    }

    /// Bytes from the data pointer to the end of the last element.
    pub fn span_bytes(&self) -> usize {
        if self.numel() == 0 {
            0
        } else {
            (self.max_element_offset().unwrap_or(0) + 1) * self.dtype.size()
        }
    }

    /// True when the elements are laid out row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1isize;
        for d in (0..self.ndim).rev() {
            if self.shape[d] != 1 && self.strides[d] != expected {
                return false;
            }
            expected *= self.shape[d] as isize;
        }
        true
    }

    /// True when no two elements share an address (required of outputs).
    pub fn is_non_overlapping(&self) -> bool {
        if self.numel() <= 1 {
            return true;
        }
        let mut dims = [(0usize, 0usize); MAX_DIMS];
        let mut nd = 0;
        for (&n, &s) in self.shape().iter().zip(self.strides()) {
            if n > 1 {
                dims[nd] = (s as usize, n);
                nd += 1;
            }
        }
        let dims = &mut dims[..nd];
        dims.sort_unstable();
        let mut extent = 1usize; // elements spanned by the faster dimensions
        for &mut (stride, n) in dims {
            if stride < extent {
                return false;
            }
            extent += stride * (n - 1);
        }
        true
    }

    /// Fails unless the view lives in `memory`; `what` names the argument in the message.
    pub fn expect_memory(&self, memory: MemoryKind, what: &str) -> Result<()> {
        if self.memory != memory {
            return Err(Error::InvalidArgument(format!(
                "{what} is in {} memory but this context's backend works on {memory} memory",
                self.memory
            )));
        }
        Ok(())
    }
}

/// Row-major strides for `shape` (entries past `shape.len()` are 0).
pub fn contiguous_strides(shape: &[usize]) -> [isize; MAX_DIMS] {
    let mut strides = [0isize; MAX_DIMS];
    let mut s = 1isize;
    for d in (0..shape.len().min(MAX_DIMS)).rev() {
        strides[d] = s;
        s = s.saturating_mul(shape[d] as isize);
    }
    strides
}

/// The iteration space shared by several views of one shape, with as few dimensions as
/// possible: size-1 dimensions dropped and neighbours merged where every view allows it.
/// An empty `shape` means a single element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StridedLoop<const N: usize> {
    /// Extent of each remaining dimension, outermost first.
    pub shape: Vec<usize>,
    /// Per view, the stride of each remaining dimension, in elements.
    pub strides: [Vec<isize>; N],
}

impl<const N: usize> StridedLoop<N> {
    /// Coalesces the dimensions of `views`, which must all have the same shape.
    pub fn new(views: [&TensorView; N]) -> Self {
        let shape_in = views[0].shape();
        let mut shape: Vec<usize> = Vec::with_capacity(shape_in.len());
        let mut strides: [Vec<isize>; N] = std::array::from_fn(|_| Vec::new());
        for (d, &n) in shape_in.iter().enumerate() {
            if n == 1 {
                continue;
            }
            let can_merge = !shape.is_empty()
                && (0..N).all(|v| {
                    let last = *strides[v].last().unwrap();
                    last == views[v].strides()[d] * n as isize
                });
            if can_merge {
                *shape.last_mut().unwrap() *= n;
                for (v, s) in strides.iter_mut().enumerate() {
                    *s.last_mut().unwrap() = views[v].strides()[d];
                }
            } else {
                shape.push(n);
                for (v, s) in strides.iter_mut().enumerate() {
                    s.push(views[v].strides()[d]);
                }
            }
        }
        StridedLoop { shape, strides }
    }

    /// Number of elements in the loop.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element offsets, per view, of flat index `i` (row-major over `shape`).
    pub fn offsets(&self, mut i: usize) -> [isize; N] {
        let mut off = [0isize; N];
        for d in (0..self.shape.len()).rev() {
            let n = self.shape[d];
            let idx = (i % n) as isize;
            i /= n;
            for (v, o) in off.iter_mut().enumerate() {
                *o += idx * self.strides[v][d];
            }
        }
        off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(shape: &[usize], strides: &[isize]) -> TensorView {
        TensorView::new(0x1000, DType::F32, MemoryKind::Host, shape, strides).unwrap()
    }

    #[test]
    fn rejects_malformed_views() {
        let too_many = [1usize; MAX_DIMS + 1];
        assert!(matches!(
            TensorView::new(
                0x1000,
                DType::F32,
                MemoryKind::Host,
                &too_many,
                &[1; MAX_DIMS + 1]
            ),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            TensorView::new(0, DType::F32, MemoryKind::Host, &[2], &[1]),
            Err(Error::NullArgument(_))
        ));
        // NULL is fine for an empty tensor.
        assert!(TensorView::new(0, DType::F32, MemoryKind::Host, &[0, 4], &[4, 1]).is_ok());
        assert!(matches!(
            TensorView::new(0x1002, DType::F32, MemoryKind::Host, &[2], &[1]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            TensorView::new(0x1000, DType::F32, MemoryKind::Host, &[2], &[-1]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            TensorView::new(
                0x1000,
                DType::F32,
                MemoryKind::Host,
                &[usize::MAX, 2],
                &[2, 1]
            ),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            TensorView::new(
                0x1000,
                DType::F32,
                MemoryKind::Host,
                &[3, 3],
                &[isize::MAX / 2, 1]
            ),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            TensorView::new(0x1000, DType::F32, MemoryKind::Host, &[2, 2], &[1]),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn contiguity_and_overlap() {
        assert!(host(&[2, 3], &[3, 1]).is_contiguous());
        assert!(host(&[2, 1, 3], &[3, 99, 1]).is_contiguous());
        assert!(!host(&[2, 3], &[4, 1]).is_contiguous());
        assert!(host(&[2, 3], &[4, 1]).is_non_overlapping());
        assert!(host(&[2, 3], &[1, 2]).is_non_overlapping());
        assert!(!host(&[2, 3], &[1, 1]).is_non_overlapping());
        assert!(!host(&[4], &[0]).is_non_overlapping());
        assert!(host(&[1], &[0]).is_non_overlapping());
        assert_eq!(host(&[2, 3], &[4, 1]).span_bytes(), (4 + 2 + 1) * 4);
    }

    #[test]
    fn loops_coalesce_and_index() {
        let a = host(&[2, 3, 4], &[12, 4, 1]);
        let b = host(&[2, 3, 4], &[24, 8, 2]);
        let l = StridedLoop::new([&a, &b]);
        assert_eq!(l.shape, vec![24]);
        assert_eq!(l.strides, [vec![1], vec![2]]);
        let c = host(&[2, 3, 4], &[16, 4, 1]); // padded rows
        let l = StridedLoop::new([&a, &c]);
        assert_eq!(l.shape, vec![2, 12]);
        assert_eq!(l.offsets(13), [13, 17]);
        let one = host(&[1, 1], &[5, 7]);
        let l = StridedLoop::new([&one]);
        assert!(l.shape.is_empty());
        assert_eq!(l.numel(), 1);
        assert_eq!(l.offsets(0), [0]);
    }
}
