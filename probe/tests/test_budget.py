import unittest

from probe.gpucast_probe.budget import Budget
from probe.gpucast_probe.generators import generate
from probe.gpucast_probe.runner import Outcome, run_jobs


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class BudgetPlanning(unittest.TestCase):
    def test_a_job_gets_its_full_time_while_there_is_plenty(self):
        clock = Clock()
        budget = Budget(10, reserve_seconds=15, clock=clock)
        self.assertEqual(budget.plan_job(60, 60, 10), (60, 120))

    def test_near_the_end_a_job_gets_less_and_then_none(self):
        clock = Clock()
        budget = Budget(10, reserve_seconds=15, clock=clock)
        clock.now += 600 - 15 - 60 - 30  # 90 s usable
        self.assertEqual(budget.plan_job(60, 60, 10), (30, 90))
        clock.now += 25  # 65 s usable: 5 s of training is not worth a job
        self.assertIsNone(budget.plan_job(60, 60, 10))
        clock.now += 10_000
        self.assertEqual(budget.remaining(), 0.0)
        self.assertIsNone(budget.plan_job(60, 60, 10))

    def test_the_budget_must_be_positive(self):
        for minutes in (0, -1, float("nan")):
            with self.assertRaises(ValueError):
                Budget(minutes)


class RunLoop(unittest.TestCase):
    def test_jobs_never_run_past_the_budget(self):
        clock = Clock()
        budget = Budget(10, reserve_seconds=15, clock=clock)
        started = clock.now
        timeouts = []

        def execute(spec, train, timeout):
            # The worst case: every job runs until the parent kills it.
            timeouts.append(timeout)
            clock.now += timeout
            return Outcome(status="timeout")

        outcomes = []
        ran = run_jobs(generate(["mlp", "cnn"], 0), budget, execute, lambda s, o: outcomes.append(o), 60, 60, 10)
        self.assertEqual(ran, len(outcomes))
        self.assertEqual(ran, 5)  # 4 x 120 s, then one of 105 s (45 s of training)
        self.assertLessEqual(clock.now - started, 600 - 15)
        self.assertLessEqual(clock.now - started + budget.reserve, 600)
        self.assertTrue(all(t > 0 for t in timeouts))

    def test_max_jobs_stops_early(self):
        budget = Budget(60, clock=Clock())
        ran = run_jobs(generate(["mlp"], 0), budget, lambda s, t, to: Outcome("ok"), lambda s, o: None, 60, 60, 10, 3)
        self.assertEqual(ran, 3)


if __name__ == "__main__":
    unittest.main()
