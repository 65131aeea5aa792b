// Fault injection for the reliability tests. KVX_FAULT="site[@first[-last]],..." makes
// fault_at(site) true on the listed calls (1-based; "site" alone = the first call) of that site
// in this process (counts restart when KVX_FAULT changes). Unset (every normal run), fault_at
// is always false.
// Sites: checkpoint.mid_write, checkpoint.before_latest, checkpoint.mid_prune, train.kill (after a step; the process
// kills itself there), train.nan_loss (the step's loss becomes NaN).
#pragma once

namespace kvx {

bool fault_at(const char* site);

}  // namespace kvx
