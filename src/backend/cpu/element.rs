//! Element types the CPU kernels are generic over, with f32 conversions that round the
//! way the CUDA kernels do (round to nearest even).

use half::{bf16, f16};

/// A storable element: f32, f16 or bf16.
pub trait Element: Copy + Send + Sync + 'static {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Narrows from f32, rounding to nearest even.
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for i32 {
    // Only ever copied bit for bit (i32 to i32); the conversions exist for completeness.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x as i32
    }
}

/// Calls `$body` with `$t` bound to the Rust element type of `$dtype`.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::tensor::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::tensor::DType::F16 => {
                type $t = half::f16;
                $body
            }
            $crate::tensor::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::tensor::DType::I32 => {
                type $t = i32;
                $body
            }
        }
    };
}
