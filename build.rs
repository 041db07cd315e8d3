//! Compiles every `src/cuda/*.cu` to PTX (one module per file) when the `cuda` feature is on.
//! The PTX goes to `OUT_DIR` together with `ptx.rs`, which `src/cuda/mod.rs` includes.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda::build_ptx();
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::{Path, PathBuf};
    use std::time::SystemTime;

    const KERNEL_DIR: &str = "src/cuda";

    fn files_with_extension(ext: &str) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(KERNEL_DIR)
            .expect("src/cuda exists")
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|e| e == ext))
            .collect();
        files.sort();
        files
    }

    fn modified(path: &Path) -> Option<SystemTime> {
        std::fs::metadata(path).and_then(|m| m.modified()).ok()
    }

    fn nvcc_available() -> bool {
        std::process::Command::new("nvcc")
            .arg("--version")
            .output()
            .is_ok_and(|out| out.status.success())
    }

    pub fn build_ptx() {
        println!("cargo:rerun-if-changed={KERNEL_DIR}");
        println!("cargo:rerun-if-env-changed=CARGO_FEATURE_TUNING");
        println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
        if !nvcc_available() {
            panic!(
                "\n\ncandle-fastops: the `cuda` feature needs `nvcc` (CUDA toolkit 13.0) on PATH.\n\
                 Install the CUDA toolkit, or on a machine without one run\n    \
                 eval \"$(scripts/cuda-toolkit.sh)\"\n\
                 which installs the build toolkit from NVIDIA's PyPI wheels and sets CUDA_ROOT, PATH\n\
                 and CUDA_COMPUTE_CAP (needed when there is no GPU/nvidia-smi to ask).\n"
            );
        }
        let kernels = files_with_extension("cu");
        let headers = files_with_extension("cuh");
        let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));

        // bindgen_cuda only compares a kernel's own mtime with its PTX, so a header edit would not
        // rebuild anything: drop PTX older than the newest header.
        let newest_header = headers.iter().filter_map(|h| modified(h)).max();
        for kernel in &kernels {
            let stem = kernel.file_stem().expect("kernel file has a name");
            let ptx = out_dir.join(stem).with_extension("ptx");
            if let (Some(header), Some(built)) = (newest_header, modified(&ptx)) {
                if built < header {
                    let _ = std::fs::remove_file(&ptx);
                }
            }
        }
        for path in kernels.iter().chain(&headers) {
            println!("cargo:rerun-if-changed={}", path.display());
        }

        let mut builder = bindgen_cuda::Builder::default()
            .kernel_paths(kernels)
            .include_paths(headers)
            .arg("-std=c++17");
        // Bench-only kernel variants are compiled with the `tuning` feature only.
        if std::env::var_os("CARGO_FEATURE_TUNING").is_some() {
            builder = builder.arg("-DFASTOPS_TUNING");
        }
        let bindings = builder
            .arg("-O3")
            .arg("--use_fast_math")
            .arg("-lineinfo")
            .out_dir(out_dir.clone())
            .build_ptx()
            .expect("compiling src/cuda/*.cu to PTX");
        bindings
            .write(out_dir.join("ptx.rs"))
            .expect("writing ptx.rs");
    }
}
