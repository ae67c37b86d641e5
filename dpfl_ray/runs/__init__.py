"""Run directories and what reads them: records, bundles, reports and sweeps."""
