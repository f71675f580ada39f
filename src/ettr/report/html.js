// Interaction of the ettr HTML report: hovering a bucket (legend or chart) highlights it everywhere.
// The charts are plain SVG and read without this script; it only adds emphasis. Its last act marks the
// page as scripted, which the browser test looks for to know it ran without an error.
(function () {
  "use strict";
  var root = document.documentElement;
  var items = document.querySelectorAll("[data-bucket]");
  for (var i = 0; i < items.length; i++) {
    items[i].addEventListener("mouseenter", function (event) {
      root.setAttribute("data-focus", event.currentTarget.getAttribute("data-bucket"));
    });
    items[i].addEventListener("mouseleave", function () {
      root.removeAttribute("data-focus");
    });
  }
  root.setAttribute("data-ettr-script", "ok");
})();
