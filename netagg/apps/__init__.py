"""netagg's applications, on the host library (`host`) and the simulated switch (`sim`): the
`netagg` command line (`cli`, a module per command in `commands`, their argument types in
`arguments`), the demo, the benchmarks, `netagg probe`, the training runs and `netagg
scale`."""
