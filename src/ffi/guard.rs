//! The panic boundary and the thread-local last-error message.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::status::{kvr_status, status_of, KVR_STATUS_OK};
use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `message` as this thread's last error.
pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(c));
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `body`; turns an error into its status (recording the message) and a panic into
/// `KVR_STATUS_PANIC`. `function` names the exported function in messages.
pub(crate) fn guard<F>(function: &str, body: F) -> kvr_status
where
    F: FnOnce() -> Result<()>,
{
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => KVR_STATUS_OK,
        Ok(Err(e)) => {
            set_last_error(&format!("{function}: {e}"));
            status_of(&e)
        }
        Err(payload) => {
            let e = Error::Panic(panic_message(payload.as_ref()));
            set_last_error(&format!("{function}: {e}"));
            status_of(&e)
        }
    }
}

/// Runs `body` for a function that returns a value rather than a status; a panic records
/// the message and returns `fallback`.
pub(crate) fn guard_value<T, F>(function: &str, fallback: T, body: F) -> T
where
    F: FnOnce() -> T,
{
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            let e = Error::Panic(panic_message(payload.as_ref()));
            set_last_error(&format!("{function}: {e}"));
            fallback
        }
    }
}

/// Returns the message of the last failure on the calling thread.
///
/// Returns: a NUL-terminated message naming the function and the reason, or "" if no call
/// on this thread has failed. Never NULL. Successful calls do not clear it.
/// Ownership: the library's; valid until the next failing kvreplay call on the same thread.
/// Do not free it.
/// Thread safety: thread-safe; each thread has its own message.
/// On failure: cannot fail.
#[no_mangle]
pub extern "C" fn kvr_error_last_message() -> *const c_char {
    LAST_ERROR.with(|e| match e.borrow().as_ref() {
        Some(c) => c.as_ptr(),
        None => c"".as_ptr(),
    })
}

/// Fails with `NullArgument` naming `what` when `p` is NULL.
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::NullArgument(format!("{what} is NULL")));
    }
    Ok(())
}

/// Largest `struct_size` an input struct may declare: a larger value is not a struct of
/// any kvreplay version (most likely an uninitialized field), and reading that far could
/// run past the caller's memory.
pub(crate) const MAX_STRUCT_SIZE: usize = 4096;

/// Reads a versioned parameter struct whose first field is `uint32_t struct_size`:
/// fields past `struct_size` keep their values from `defaults`; a `struct_size` smaller
/// than `min_size` (the first published layout) is an error. A `struct_size` larger than
/// this library's layout (a caller built against a newer header) is accepted only when
/// every byte past our layout is zero: a non-zero byte there sets a field this library
/// does not know, a request it cannot honour, so it is refused rather than ignored.
///
/// # Safety
/// `p` must be non-NULL and point at `struct_size` readable bytes.
pub(crate) unsafe fn read_versioned<T: Copy>(
    p: *const T,
    defaults: T,
    min_size: usize,
    what: &str,
) -> Result<T> {
    let declared = (p as *const u32).read_unaligned() as usize;
    if declared < min_size {
        return Err(Error::InvalidArgument(format!(
            "{what}.struct_size is {declared} but must be at least {min_size}; \
             initialize it with the matching _params_default function"
        )));
    }
    if declared > MAX_STRUCT_SIZE {
        return Err(Error::InvalidArgument(format!(
            "{what}.struct_size is {declared}, more than any kvreplay struct \
             ({MAX_STRUCT_SIZE} at most); initialize it with the matching _params_default function"
        )));
    }
    if declared > size_of::<T>() {
        let tail = std::slice::from_raw_parts(
            (p as *const u8).add(size_of::<T>()),
            declared - size_of::<T>(),
        );
        if let Some(i) = tail.iter().position(|&b| b != 0) {
            return Err(Error::InvalidArgument(format!(
                "{what}.struct_size is {declared} but this library knows {} bytes, and byte {} \
                 past them is not zero: it sets a field of a newer kvreplay that this library \
                 cannot honour (link the matching library, or leave the new fields zero)",
                size_of::<T>(),
                size_of::<T>() + i
            )));
        }
    }
    let mut out = defaults;
    let n = declared.min(size_of::<T>());
    std::ptr::copy_nonoverlapping(p as *const u8, &mut out as *mut T as *mut u8, n);
    // The struct_size field itself describes the caller's layout, not ours.
    (&mut out as *mut T as *mut u32).write(size_of::<T>() as u32);
    Ok(out)
}

/// Writes an output struct that carries `uint32_t struct_size` first: at most the
/// caller's `struct_size` bytes are written, never more than our own layout.
///
/// # Safety
/// `out` must be non-NULL and point at `struct_size` writable bytes.
pub(crate) unsafe fn write_versioned<T: Copy>(
    out: *mut T,
    value: T,
    min_size: usize,
    what: &str,
) -> Result<()> {
    let declared = (out as *const u32).read_unaligned() as usize;
    if declared < min_size {
        return Err(Error::InvalidArgument(format!(
            "{what}.struct_size is {declared} but must be at least {min_size}; set it to sizeof({what})"
        )));
    }
    let n = declared.min(size_of::<T>());
    std::ptr::copy_nonoverlapping(&value as *const T as *const u8, out as *mut u8, n);
    (out as *mut u32).write_unaligned(n as u32);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::status::*;

    #[test]
    fn panics_become_a_status_and_a_message() {
        let s = guard("kvr_test_fn", || panic!("kaboom {}", 7));
        assert_eq!(s, KVR_STATUS_PANIC);
        let msg = unsafe { std::ffi::CStr::from_ptr(kvr_error_last_message()) };
        let msg = msg.to_str().unwrap();
        assert!(
            msg.contains("kvr_test_fn") && msg.contains("kaboom 7"),
            "{msg}"
        );
        assert_eq!(
            guard_value("kvr_test_fn", -1, || -> i32 { panic!("x") }),
            -1
        );
        let e = guard("kvr_test_fn", || Err(Error::OutOfRange("too far".into())));
        assert_eq!(e, KVR_STATUS_OUT_OF_RANGE);
    }

    #[test]
    fn versioned_reads_and_writes() {
        #[derive(Clone, Copy, Debug)]
        #[repr(C)]
        struct P {
            struct_size: u32,
            a: i32,
            b: i32,
        }
        let d = P {
            struct_size: 12,
            a: 1,
            b: 2,
        };
        let short = P {
            struct_size: 8,
            a: 10,
            b: 20,
        };
        let r = unsafe { read_versioned(&short, d, 8, "P") }.unwrap();
        assert_eq!((r.struct_size, r.a, r.b), (12, 10, 2));
        let tiny = P {
            struct_size: 4,
            a: 10,
            b: 20,
        };
        assert!(unsafe { read_versioned(&tiny, d, 8, "P") }.is_err());
        // A newer caller's larger struct: accepted with a zero tail, refused otherwise.
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Newer {
            p: P,
            extra: [u8; 8],
        }
        let mut newer = Newer {
            p: P {
                struct_size: size_of::<Newer>() as u32,
                a: 7,
                b: 8,
            },
            extra: [0; 8],
        };
        let r = unsafe { read_versioned(&newer as *const Newer as *const P, d, 8, "P") }.unwrap();
        assert_eq!((r.struct_size, r.a, r.b), (12, 7, 8));
        newer.extra[5] = 1;
        let e =
            unsafe { read_versioned(&newer as *const Newer as *const P, d, 8, "P") }.unwrap_err();
        assert!(e.to_string().contains("byte 17"), "{e}");
        let huge = P {
            struct_size: MAX_STRUCT_SIZE as u32 + 1,
            a: 0,
            b: 0,
        };
        assert!(unsafe { read_versioned(&huge, d, 8, "P") }.is_err());
        let mut out = P {
            struct_size: 8,
            a: 0,
            b: 0,
        };
        unsafe {
            write_versioned(
                &mut out,
                P {
                    struct_size: 12,
                    a: 5,
                    b: 6,
                },
                4,
                "P",
            )
        }
        .unwrap();
        assert_eq!((out.struct_size, out.a, out.b), (8, 5, 0));
    }
}
