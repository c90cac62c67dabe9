fn main() -> std::process::ExitCode {
    nvdra::cli::main()
}
