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

/// Reads a versioned parameter struct whose first field is `uint32_t struct_size`:
/// fields past `struct_size` keep their values from `defaults`; a `struct_size` smaller
/// than `min_size` (the first published layout) is an error.
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
        #[derive(Clone, Copy)]
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
