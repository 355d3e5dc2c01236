/// Freed memory is zeroed: a forked call must not find another's bytes.
#[global_allocator]
static ALLOCATOR: fluksio_zygote::scrub::ZeroOnFree = fluksio_zygote::scrub::ZeroOnFree;

fn main() -> std::process::ExitCode {
    fluksio_zygote::cli::main()
}
