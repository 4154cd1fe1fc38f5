"""Pipeline parallelism: schedules as data, their simulator and checks, the stage split and the executor."""
