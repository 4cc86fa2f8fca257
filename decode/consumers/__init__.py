"""The engines that serve what polyspec publishes, run for real: their environments, their runners, and the
commands chain.json gives users to serve a chain with them."""
