//! Links the stand-in so that it is never unloaded: the backend opens it under three names and
//! closes some handles, and a kernel fault handler installed by it must outlive every handle.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
