"""Types that every process role may import: what a request asks of the sampler
(``sampling``) and the architecture parameters read from a model's config (``model_spec``).
Plain Python and the generated messages only: the gateway imports these and runs no model
(the layer rules in pyproject.toml, checked by ``lint-imports``)."""
