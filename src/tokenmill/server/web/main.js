// The page: the API key field, the two views (#playground, #dashboard) and the banner that says
// why data is missing (most often: this server needs an API key).

import { call, getKey, setKey } from "./api.js";
import * as dashboard from "./dashboard.js";
import * as playground from "./playground.js";

const $ = (id) => document.getElementById(id);
const errors = {}; // source -> message; the banner shows them

const AUTH = "This server needs its API key: type it in the API key field above (it is kept in this " +
  "browser's localStorage).";

function report(source, e) {
  if (e) errors[source] = e.status === 401 ? AUTH : `${source}: ${e.message}`;
  else delete errors[source];
  const text = [...new Set(Object.values(errors))].join(" ");
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

async function refreshServer() {
  try {
    const models = await playground.loadModels();
    const { version } = await (await call("version")).json();
    $("server-info").textContent = `${models.join(", ")} · tokenmill ${version}`;
    report("models", null);
  } catch (e) {
    report("models", e);
  }
}

function showView(view) {
  for (const tab of document.querySelectorAll(".tab")) {
    const on = tab.dataset.view === view;
    tab.classList.toggle("active", on);
    $(`view-${tab.dataset.view}`).hidden = !on;
  }
  dashboard.show(view === "dashboard");
}

function init() {
  const key = $("api-key");
  key.value = getKey();
  key.addEventListener("change", () => {
    setKey(key.value.trim());
    refreshServer();
  });
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      history.replaceState(null, "", `#${tab.dataset.view}`);
      showView(tab.dataset.view);
    });
  }
  showView(location.hash === "#dashboard" ? "dashboard" : "playground");
  playground.init();
  refreshServer();
  dashboard.start((e) => report("metrics", e));
}

init();
