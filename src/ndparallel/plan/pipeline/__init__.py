"""Pipeline parallel in the planner (``parallel/pp/``): the schedules' bubble and in-flight
micro-batches, each pp rank's share of the model, and a pp layout's estimate."""
