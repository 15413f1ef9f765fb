"""Case builders and registrations, one module per stage family. `moebench.registry.load_all` imports every
module here (no hand-kept list); each registers its impls with `registry.register_impl`."""
