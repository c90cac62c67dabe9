//! (being built for issue 37; see `issues show 37`.)

/// Flags of `nvdra compute-domain controller`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the controller until it is told to stop.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the compute-domain controller is not built yet")
}
