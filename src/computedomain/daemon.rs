//! (being built for issue 37; see `issues show 37`.)

/// Flags of `nvdra compute-domain daemon`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the daemon until it is told to stop.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the compute-domain daemon is not built yet")
}
