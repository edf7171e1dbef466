"""netagg's applications, on the host library (`host`) and the simulated switch (`sim`): the
`netagg` command line, the demo, the benchmarks, `netagg probe`, the training runs and
`netagg scale`."""
