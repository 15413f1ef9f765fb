"""Running a sweep: loading and expanding it (sweep, strict_yaml, paths), running its points (runner, point, the
point worker that isolates them, multirank and dist for rank groups), and the run directory (results: a new one
and its manifest's contents; resume, lock), whose files' format is moebench.records.

Modules here may import moebench.params, registry, families, plugins, presets, check, consistency and the library
packages (kernels, inputs, dispatch, measure, bench), and moebench.report for the table the runner prints; nothing below
(the registry, the library packages) imports this package.
"""
