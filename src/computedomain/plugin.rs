//! (being built for issue 37; see `issues show 37`.)

/// Flags of `nvdra compute-domain plugin`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the plugin until it is told to stop.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("the compute-domain plugin is not built yet")
}
