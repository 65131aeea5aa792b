#include "compare/report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "eval/plot.h"
#include "io/atomic_file.h"

namespace kvx::compare {

namespace {

struct Column {
  std::string metric, header, format;
};

std::string cell(const nlohmann::json& metrics, const Column& c) {
  if (!metrics.contains(c.metric)) return "";
  char buf[64];
  const double v = metrics[c.metric].get<double>();
  if (c.format == "int")
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else if (c.format == "pct")
    std::snprintf(buf, sizeof buf, "%.1f%%", 100 * v);
  else if (c.format == "pct2")
    std::snprintf(buf, sizeof buf, "%.2f%%", 100 * v);
  else if (c.format == "pp")
    std::snprintf(buf, sizeof buf, "%+.2f", 100 * v);
  else if (c.format == "kib")
    std::snprintf(buf, sizeof buf, "%.1f", v / 1024);
  else
    std::snprintf(buf, sizeof buf, c.format.c_str(), v);
  return buf;
}

// A line's points in order of x.
eval::Series sorted_by_x(const eval::Series& s) {
  std::vector<size_t> order(s.x.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t i, size_t j) { return s.x[i] < s.x[j]; });
  eval::Series sorted{s.title, {}, {}};
  for (size_t i : order) sorted.x.push_back(s.x[i]), sorted.y.push_back(s.y[i]);
  return sorted;
}

std::vector<Column> columns_for(const ExperimentResult& r) {
  std::vector<Column> all = {
      {"kv_bytes_per_token", "KV bytes/token", "int"}, {"kv_pct_of_mha", "% of MHA", "%.1f"},
      {"softmax_fraction", "softmax blocks", "pct"},
      {"kv_state_bytes_per_token@4K", "KV+state B/tok @4K", "int"}, {"kv_state_bytes_per_token@16K", "KV+state B/tok @16K", "int"},
      {"params", "params", "int"},                     {"test_ce", "test CE", "%.4f"},
      {"test_bpb", "bits/byte", "%.4f"},               {"kl_vs_reference", "KL vs ref", "%.5f"},
      {"top1_agreement", "top-1 agree", "pct"},        {"compression", "compression", "%.2fx"}};
  if (r.experiment.eval.capacity_tokens > 0) {
    const std::string k = "capacity@" + std::to_string(r.experiment.eval.capacity_tokens / 1024) + "K";
    all.push_back({k, "seqs of " + std::to_string(r.experiment.eval.capacity_tokens / 1024) + "K in " +
                          std::to_string(r.experiment.eval.capacity_mib) + " MiB", "int"});
  }
  for (int p : r.experiment.eval.mqar_pairs) all.push_back({"mqar@" + std::to_string(p), "MQAR@" + std::to_string(p), "pct"});
  for (int m : r.experiment.eval.context_multiples)
    all.push_back({"ppl@" + std::to_string(m) + "x", "PPL " + std::to_string(m) + "x", "%.1f"});
  for (int64_t c : r.experiment.eval.decode_contexts)
    all.push_back({"decode_tok_s@" + std::to_string(c / 1024) + "K", "tok/s @" + std::to_string(c / 1024) + "K", "%.1f"});
  for (int64_t c : r.experiment.eval.prefill_contexts)
    all.push_back({"prefill_s@" + std::to_string(c / 1024) + "K", "prefill s @" + std::to_string(c / 1024) + "K", "%.2f"});
  if (r.experiment.name == "doc") {  // Nectar: only the document columns
    all = {{"document_tokens", "doc tokens", "int"},      {"budget_fraction", "module / doc KV", "pct2"},
           {"kl", "KL test", "%.4f"},                     {"kl_challenge", "KL challenge", "%.4f"},
           {"accuracy_gap", "acc. gap test (pp)", "pp"},  {"accuracy_gap_challenge", "acc. gap chall. (pp)", "pp"},
           {"teacher_accuracy", "full-doc acc.", "pct"},  {"alpha_mse", "alpha MSE", "%.3f"},
           {"content_mse", "A MSE", "%.3f"},              {"state_bytes", "state KiB", "kib"},
           {"ttft_ms", "TTFT ms", "%.1f"},                {"ttft_ms_prefix", "TTFT prefix ms", "%.1f"},
           {"decode_tok_s", "decode tok/s", "%.1f"},      {"fit_s", "fit s", "%.0f"},
           {"amortise_requests", "requests to amortise", "int"}};
  }
  std::vector<Column> used;
  for (const auto& c : all) {
    bool any = false;
    for (const auto& a : r.arms) any = any || a.metrics.contains(c.metric);
    if (any) used.push_back(c);
  }
  return used;
}

std::string table(const ExperimentResult& r) {
  auto cols = columns_for(r);
  std::ostringstream t;
  t << "| arm | kind |";
  for (const auto& c : cols) t << " " << c.header << " |";
  t << "\n|---|---|";
  for (size_t i = 0; i < cols.size(); ++i) t << "---:|";
  t << "\n";
  for (const auto& a : r.arms) {
    t << "| " << a.name << " | " << a.kind << " |";
    for (const auto& c : cols) t << " " << cell(a.metrics, c) << " |";
    t << "\n";
  }
  return t.str();
}

}  // namespace

std::string write_report(const ExperimentResult& r) {
  const auto& e = r.experiment;
  io::write_file_atomic(r.dir + "/results.json", results_json(r).dump(1) + "\n");
  std::vector<std::string> plots;
  // Cache vs quality: one point per arm.
  std::vector<eval::Series> pareto, mqar, curves, decode;
  for (const auto& a : r.arms) {
    if (a.metrics.contains("test_ce"))
      pareto.push_back({a.name, {a.metrics["kv_bytes_per_token"].get<double>()}, {a.metrics["test_ce"].get<double>()}});
    if (!a.mqar.empty()) {
      eval::Series s{a.name, {}, {}};
      for (auto [p, acc] : a.mqar) s.x.push_back(p), s.y.push_back(acc);
      mqar.push_back(s);
    }
    if (!a.curve.is_null() && a.curve.contains("val_ce") && !a.curve["val_ce"].empty()) {
      eval::Series s{a.name + " train loss", a.curve["step"].get<std::vector<double>>(), a.curve["train_loss"].get<std::vector<double>>()};
      curves.push_back(s);
    }
    eval::Series d{a.name, {}, {}};
    for (int64_t c : e.eval.decode_contexts) {
      const std::string k = "decode_tok_s@" + std::to_string(c / 1024) + "K";
      if (a.metrics.contains(k)) d.x.push_back(static_cast<double>(c)), d.y.push_back(a.metrics[k].get<double>());
    }
    if (!d.x.empty()) decode.push_back(d);
  }
  const std::string tag = e.name + " (" + e.preset + ")";
  auto plot = [&](const std::string& file, const std::string& title, const std::string& x, const std::string& y,
                  const std::vector<eval::Series>& s, bool log_y = false) {
    if (!s.empty() && eval::plot_lines(r.dir + "/" + file, title, x, y, s, log_y)) plots.push_back(file);
  };
  plot("pareto.png", "cache vs quality: " + tag, "KV cache bytes per token", "test cross-entropy (nats/token)", pareto);
  plot("mqar.png", "MQAR recall: " + tag, "key-value pairs", "accuracy", mqar);
  plot("loss.png", "training loss: " + tag, "step", "train loss (nats/token, text + MQAR mix)", curves);
  plot("decode.png", "decode speed: " + tag, "context (tokens)", "tokens/s (whole model, one token per step)", decode);
  {  // Looped models: KL vs the teacher against the compression of its persistent cache, one line per
     // codec family (plain fits), every other arm (distilled, evicted, absorbed) a point.
    std::map<std::string, eval::Series> families;
    std::vector<eval::Series> kl;
    for (const auto& a : r.arms) {
      if (!a.metrics.contains("compression") || !a.metrics.contains("kl_vs_reference")) continue;
      // Log scale: KL spans 1e-6 .. 1; a lossless arm sits at the floor.
      const double x = a.metrics["compression"].get<double>(), y = std::max(1e-6, a.metrics["kl_vs_reference"].get<double>());
      nlohmann::json spec;
      for (const auto& arm : e.arms)
        if (arm.name == a.name) spec = arm.spec;
      std::string family;
      if (a.kind == "posthoc" && spec.value("evict", "").empty() && !spec.contains("share_kv_layers")) family = "KV quantization";
      if (a.kind == "lla" && spec.value("steps", 0) == 0 && !spec.contains("evict") && !spec.value("absorbed", false))
        family = spec.value("variant", "head") == "head"   ? "LLA (per head)"
                 : spec.value("variant", "") == "2d"        ? "LLA-2D"
                 : spec.value("variant", "") == "loop_head" ? "head codec (per loop)"
                                                             : "final-loop reuse";
      if (family.empty()) {
        kl.push_back({a.name, {x}, {y}});
        continue;
      }
      auto& f = families[family];
      f.title = family;
      f.x.push_back(x), f.y.push_back(y);
    }
    for (auto& [name, f] : families) kl.insert(kl.begin(), sorted_by_x(f));  // lines run in order of compression
    plot("loop-budget.png", "looped model cache vs fidelity: " + tag, "compression of the persistent cache (x)",
         "KL(teacher || student), nats/token (log scale, floor 1e-6)", kl, true);
  }
  {  // Nectar: per document, test KL against the module's share of the document's KV, a line per (arch, objective)
    std::map<std::string, std::map<std::string, eval::Series>> docs;
    std::map<std::string, double> none;
    for (const auto& a : r.arms) {
      const auto slash = a.name.find('/');
      if (slash == std::string::npos || !a.metrics.contains("kl")) continue;
      const std::string doc = a.name.substr(0, slash);
      if (a.kind == "document") {
        if (a.name.substr(slash + 1) == "no-document") none[doc] = a.metrics["kl"].get<double>();
        continue;
      }
      const std::string rest = a.name.substr(slash + 1);  // mlp-5%-mixed
      const std::string family = rest.substr(0, rest.find('-')) + " " + rest.substr(rest.rfind('-') + 1);
      auto& f = docs[doc][family];
      f.title = family;
      f.x.push_back(100 * a.metrics["budget_fraction"].get<double>());
      f.y.push_back(std::max(1e-5, a.metrics["kl"].get<double>()));
    }
    for (auto& [doc, families] : docs) {
      std::vector<eval::Series> lines;
      double lo = 1e30, hi = 0;
      for (auto& [name, f] : families) {
        lines.push_back(sorted_by_x(f));
        lo = std::min(lo, lines.back().x.front()), hi = std::max(hi, lines.back().x.back());
      }
      if (none.count(doc)) lines.push_back({"no document", {lo, hi}, {none[doc], none[doc]}});
      plot("doc-budget-" + doc + ".png", "Nectar on " + doc + ": " + tag, "module size (% of the document's f32 KV)",
           "KL(full document || module), nats/token, test split (log scale)", lines, true);
    }
  }
  for (const auto& a : r.arms) {  // NAtS-L: the share of blocks routed to softmax per layer and head group (seed 001 Fig. 5)
    if (a.routing.is_null() || a.routing["layers"].empty()) continue;
    std::vector<std::string> rows;
    for (int l : a.routing["layers"]) rows.push_back("layer " + std::to_string(l));
    const auto cells = a.routing["softmax_fraction"].get<std::vector<std::vector<double>>>();
    const std::string file = "routing-" + a.name + ".png";
    if (eval::plot_heatmap(r.dir + "/" + file, "blocks routed to softmax: " + a.name + " (" + tag + ")", "head group", "",
                           rows, cells, 0.0, 1.0))
      plots.push_back(file);
  }

  const std::string main_table = table(r);
  std::ostringstream md;
  md << "# kvx compare: " << tag << "\n\n" << main_table << "\n";
  for (const auto& p : plots) md << "![" << p << "](" << p << ")\n\n";
  const auto& b = e.base;
  if (e.name == "doc") {
    const auto& d = e.document;
    std::set<std::string> documents;
    for (const auto& a : e.arms)
      if (a.spec.contains("document")) documents.insert(a.spec.at("document").get<std::string>());
    std::string which;
    for (const auto& doc : documents)
      which += (which.empty() ? "" : "; ") +
               (doc == "kjv"     ? "kjv: the book of Jude"
                : doc == "brown" ? "brown: the start of Brown ca32"
                                 : "the file " + doc + ", used whole");
    md << "## Setup\n\n"
       << "One MHA model (d=" << b.model.hidden_size << ", " << b.model.num_hidden_layers << " layers, H=" << b.model.num_attention_heads
       << ", d_h=" << b.model.head_dim << ") trained " << b.train.steps << " steps on windows of " << b.train.seq_len
       << " tokens (its whole context), so a document and the queries after it sit at trained positions. Per document ("
       << which << "; the built-in ones are from the corpora's validation split, cut at a line to at most "
       << d.max_tokens << " tokens), the model makes " << d.queries << " self-study queries of " << d.query_length
       << " tokens (quote, cloze, its own sampled continuations; `kvx fit nectar`), split 80/20 with an eighth of the 80 "
          "held out for checkpoint selection; the challenge split is the quarter of the test queries least similar to any "
          "training query (cosine of token counts). Modules train " << d.steps << " steps of " << d.batch
       << " queries (AdamW, lr " << d.lr << ", warmup + cosine); objectives: reg = regression only (MLP l_alpha 0.1, l_A 1; "
          "Quadrature l_A 1), mixed = regression + 0.01 KL (the paper's default), kl = KL only.\n\n"
       << "## What the numbers mean\n\n"
       << "- **module / doc KV**: the module's f32 parameters over the document's f32 K and V of every layer (rho is per "
          "layer and KV head; widths round down).\n"
       << "- **KL test / challenge**: KL(p_full-document || p_module) per query token, teacher forced, on the test and "
          "challenge splits. **acc. gap**: next-token accuracy of the full-document model minus the module's, in "
          "percentage points (full-doc acc. is the former). no-document: the model with the document removed.\n"
       << "- **alpha MSE / A MSE**: the module's log mass and content against the exact ones, per layer and query head, "
          "on the full-document model's own queries (test split).\n"
       << "- **TTFT ms**: time to first token for a request of " << d.prompt_tokens << " prompt tokens after the document, "
          "best of " << d.repeats << ": full-document arm = prefilling the document with the request; module arms = the "
          "module in place of the document; **TTFT prefix ms** = a reused prefix KV cache of the document (prefilled "
          "once, rolled back after each request). **decode tok/s**: " << d.new_tokens << " greedy tokens after the prompt "
          "(full-document arm: with the prefix cache). **state KiB**: what the request holds: document KV or module "
          "weights, plus its own tokens' KV.\n"
       << "- **fit s**: making the queries plus fitting, on this machine; **requests to amortise**: fit s over the TTFT "
          "saved per request against prefilling the document each time. Against a reused prefix cache the module saves "
          "memory (state KiB), not time.\n";
    io::write_file_atomic(r.dir + "/report.md", md.str());
    return main_table;
  }
  md << "## Setup\n\n"
     << "Every train arm shares the data (" << b.data.sources.size() << " corpora: ";
  for (const auto& s : b.data.sources) md << s << " ";
  md << "; " << 100 * b.data.mqar_fraction << "% of training rows are MQAR sequences with up to " << b.data.mqar_max_pairs
     << " pairs), the seed (" << b.train.seed << "), " << b.train.steps << " steps of " << b.train.batch_size << " x "
     << b.train.seq_len << " tokens, and the base model (d=" << b.model.hidden_size << ", " << b.model.num_hidden_layers
     << " layers, H=" << b.model.num_attention_heads << ", d_h=" << b.model.head_dim << ", vocab " << b.model.vocab_size
     << "), except where a train arm's spec overrides them (below). Post-hoc arms transform the trained model named in their spec. Convert arms convert the trained model named "
        "in their spec to another family (`kvx convert lrkv`) and heal it with `heal_steps` more steps of training of "
        "the whole model, so their CE also reflects that extra training. Arms are cached by content hash under "
        "`arms/`; `experiment.json` holds the full declaration.\n\n";
  for (const auto& arm : r.experiment.arms)
    if (arm.kind == "train") {
      md << "- `" << arm.name << "`: model " << arm.spec.at("model").dump();
      if (arm.spec.contains("train")) md << ", train " << arm.spec.at("train").dump();
      md << "\n";
    }
  md << "\n## What the numbers mean\n\n"
     << "- **KV bytes/token**: cache bytes per token summed over layers, at the arm's element type, at the training "
        "context (" << b.train.seq_len << " tokens); an evicting cache holds at most sink + window tokens, so its figure is "
        "bytes held / context. **% of MHA**: against f32 MHA of the arm's own model, or of the trained model a derived arm "
        "starts from (2 x layers x loops x H x d_h x 4 bytes).\n"
     << "- **test CE / bits/byte**: mean next-token cross-entropy (nats) on " << e.eval.test_windows << " windows of "
     << b.train.seq_len << " tokens from the held-out test split; bits per byte divides the total by ln 2 and the UTF-8 "
        "bytes of the predicted tokens. Post-hoc arms are evaluated through their decode cache (fused kernels, every "
        "token appended then attended, so quantisation and eviction affect every prediction).\n"
     << "- **KL vs ref / top-1 agree**: post-hoc arms only; KL(p_ref || p_arm) per token and the share of tokens whose "
        "argmax matches, against the same model's uncached f32 forward.\n"
     << "- **MQAR@N**: multi-query associative recall with N key-value pairs followed by queries filling the "
     << b.train.seq_len << "-token window; share of answers predicted exactly (argmax), over " << e.eval.mqar_sequences
     << " sequences per N.\n"
     << "- **PPL kx**: perplexity on windows k times the training context (about " << e.eval.long_context_tokens
     << " tokens per k); RoPE positions beyond training are extrapolated.\n"
     << "- **tok/s @nK**: whole-model decode, one token per step at n x 1024 cached tokens, with the arm's shapes, random "
        "weights and a cache of random rows (speed does not depend on the values), fused kernels, all threads, on this "
        "machine.\n";
  io::write_file_atomic(r.dir + "/report.md", md.str());
  return main_table;
}

}  // namespace kvx::compare
