//! Without the library, creating the oneDNN device is an error that says what to do.
//! (A test binary of its own: it changes the process environment.)
#![cfg(feature = "onednn")]

use conv_runtime::OneDnn;

#[test]
fn a_missing_library_is_a_clear_error() {
    let empty = std::env::temp_dir().join(format!("conv2d-no-onednn-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    std::env::set_var("ONEDNN_LIB_DIR", &empty);
    let error = OneDnn::new().unwrap_err().to_string();
    assert!(error.contains("libdnnl.so.3"), "{error}");
    assert!(error.contains("ONEDNN_LIB_DIR"), "{error}");
    std::env::remove_var("ONEDNN_LIB_DIR");
    let error = OneDnn::new().unwrap_err().to_string();
    assert!(error.contains("ONEDNN_LIB_DIR"), "{error}");
    println!("{error}");
}
