fn main() -> std::process::ExitCode {
    fluksio_zygote::cli::main()
}
