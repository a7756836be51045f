//! The header's version macros, kvr_library_version() and Cargo.toml agree.

use std::ffi::CStr;

#[test]
fn header_macros_match_cargo_and_kvr_version() {
    let header =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/kvreplay.h"))
            .expect("include/kvreplay.h");
    let macro_value = |name: &str| -> String {
        let prefix = format!("#define {name} ");
        header
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{name} missing from the header"))
            .trim()
            .to_string()
    };
    assert_eq!(
        macro_value("KVR_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MAJOR")
    );
    assert_eq!(
        macro_value("KVR_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_MINOR")
    );
    assert_eq!(
        macro_value("KVR_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION_PATCH")
    );
    let v = unsafe { CStr::from_ptr(kvreplay::ffi::kvr_library_version()) }
        .to_str()
        .unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    assert_eq!(v, kvreplay::VERSION);
    // Stable pointer (static string).
    assert_eq!(
        kvreplay::ffi::kvr_library_version(),
        kvreplay::ffi::kvr_library_version()
    );
    let info = unsafe { CStr::from_ptr(kvreplay::ffi::kvr_library_build_info()) }
        .to_str()
        .unwrap();
    if kvreplay::ffi::kvr_library_kernels_compiled() {
        assert!(
            info.contains("sm_90a") && info.contains("compute_80"),
            "{info}"
        );
    } else {
        assert!(info.contains("without kernels"), "{info}");
    }
}
