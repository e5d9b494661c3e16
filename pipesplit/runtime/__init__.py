"""Pipeline runtime: executes split programs under schedules."""
